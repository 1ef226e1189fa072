"""Check the groups of untrusted rollout peers against the learner's own policy before they train.

A rollout peer's token ids and behaviour logprobs are self-declared (leases.py checks shapes only):
absurd logprobs (-1e30 makes the loss NaN), made-up ones, made-up text, text another sampler chose.
`GRPOTrainer.step` runs this on every batch, before the loss. Checks, reasons, defaults:
docs/protocol.md §10.4.1; the measurements behind them: docs/benchmarks.md.

Dataflow (one step at version t; b = the claimed behaviour logprobs, k = t - v the staleness of a
group of version v)::

    groups ─► the step's own forward of the policy (version t, no gradient; `score_logits`), per
              completion token under the sampling distribution π (softmax(logits / T), top-p
              nucleus renormalised, as the engines report: rollout/engines/base.py):
              q = log π(x), the surprisal s = -log π(x), H(π) and Var_π[-log π]
      └─► plausibility, every group (`Verifier.check`)
            b finite ──────────────────────────────────────────────── else "nonfinite_logprob"
            max |b - q| <= exact_tolerance + k · token_gap_per_version   else "token_gap"
            mean |b - q| <= exact_mean_tolerance + k · mean_gap_per_version else "mean_gap"
            (k = 0: the exact check, under the fp32 masters; k > 0: the exact check below decides)
      └─► seeded choices of k = 0 groups, same logits: each sent token's perturbed score (logits / T
            + the lease's noise) within δ of the best in the nucleus ──────── "sample_mismatch"
      └─► exact check of older groups (a random `sample_fraction`; a peer's first `newcomer_groups`;
            the suspicious: near a bound, atypical under q, from a peer refused, or whose re-derived
            choices strayed past `suspect_fraction` of δ, in the last `suspect_steps` steps) and of k = 0
            refusals (the masters are not the published cast): version v as published
            (`weights_of`), streamed module by module (train/streamed.py): |b - log π_v(x)| past the
            tolerances ─► "exact_mismatch"; the seeded choices under its logits ─► "sample_mismatch"
      └─► typicality under the behaviour version (exact when it ran, else q as a proxy):
            z = Σ (s - H) / sqrt(Σ Var + floor), per sequence and over the group;
            max(z) > typicality_z ──────────────────────────────────────────── "atypical_text"
      └─► refused groups' rows leave the objective before the loss; each is reported as
            (peer_id, prompt_id, reason), and its peer's older groups are checked exactly for the
            next `suspect_steps` steps
      └─► per group measured under its own version, what the per-peer tests add up (`GroupEvidence`,
            learner/evidence.py): its choice evidence and signed z (below 0: colder than sampling)

Memory: an older version's forward holds one buffer per parameter shape while it runs, no copy of
the policy (train/streamed.py; a sharded learner's rank 0 runs it and sends the logits to the other
ranks); sampling statistics in row chunks beside the step's logits.
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from echo2swarm.config.rl import VerifyConfig
from echo2swarm.train.group import Group
from echo2swarm.train.grpo import CompletionLogits
from echo2swarm.train.streamed import Streaming, TensorWeights, VersionWeights
from echo2swarm.train.exact import CheckUnavailable, ExactFigures, ExactSettings, RemoteCheck, exact_figures, row_typicality
from echo2swarm.train.scoring import VARIANCE_FLOOR, ChoiceGaps, TokenScores, choice_gaps_of
from echo2swarm.runtime.logging import get_logger
from echo2swarm.wire.sampling import SAMPLERS, completion_key

logger = get_logger(__name__)

__all__ = [
    "NO_STRIKE",
    "REASONS",
    "GroupEvidence",
    "NonFiniteWeightsError",
    "Refusal",
    "VerifyResult",
    "Verifier",
    "WeightsOf",
    "check_finite",
    "load_policy_weights",
]

REASONS = ("nonfinite_logprob", "future_version", "token_gap", "mean_gap", "exact_mismatch", "sample_mismatch",
           "atypical_text")
"""Every refusal reason `Verifier.check` gives."""

NO_STRIKE = frozenset({"atypical_text"})
"""Refusals that are statistics, not proof: honest samples reach the tail of z now and then, so they
never count toward a ban (learner/loop.py); every other reason is a verification strike."""

WeightsOf = Callable[[int], "dict[str, torch.Tensor] | Path | str | None"]
"""version -> that version's weights: tensors by name (tied duplicates may be left out), or a model
directory whose ``*.safetensors`` hold them; None when the version is not available."""


class NonFiniteWeightsError(ValueError):
    """Weights holding NaN or inf: never turned into bytes, so never signed or published."""


def check_finite(tensors: dict[str, torch.Tensor], what: str = "policy") -> None:
    """Raise NonFiniteWeightsError naming the tensors (first 5) that hold a NaN or an inf."""
    names = [n for n, t in tensors.items() if t.is_floating_point()]
    if not names:
        return
    finite = torch.stack([torch.isfinite(tensors[n]).all() for n in names]).cpu()  # one transfer, not one per tensor
    if bool(finite.all()):
        return
    bad = [n for n, ok in zip(names, finite.tolist()) if not ok]
    raise NonFiniteWeightsError(
        f"{what} has non-finite values (NaN or inf) in {len(bad)} tensor(s): {', '.join(bad[:5])}"
        f"{' ...' if len(bad) > 5 else ''}; refusing to produce its bytes"
    )


def load_policy_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``'s parameters (on whatever device they live). Names sharing
    storage with another (an lm_head tied to the embeddings) may be absent; anything else missing
    or unexpected raises ValueError("missing [...], unexpected [...]")."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    seen: set[int] = set()
    tied: set[str] = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tied.add(name)
        seen.add(ptr)
    if unexpected or set(missing) - tied:
        raise ValueError(f"missing {missing}, unexpected {unexpected}")


# ----------------------------------------------------------------------------------- scoring
# ----------------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Refusal:
    peer_id: str
    prompt_id: str
    reason: str
    detail: str = ""

    def as_tuple(self) -> tuple[str, str, str]:
        return (self.peer_id, self.prompt_id, self.reason)


@dataclass(frozen=True)
class GroupEvidence:
    """What one group adds to its peer's sequential tests (learner/evidence.py): measured under the
    group's own version only (the step's forward at k = 0, else the exact check), never the proxy."""

    peer_id: str
    prompt_id: str
    positions: int  # completion tokens whose seeded choice was re-derived (0: none)
    choice: float | None  # Σ `choice_evidence` over them; None when the choices were not re-derived
    z: float | None  # the group's signed typicality z; None when not scored under its own version
    gap: float | None = None  # nats of logits: its largest re-derived choice gap (None: choices not re-derived)


@dataclass
class VerifyResult:
    """What `Verifier.check` decided for one batch."""

    keep: list[bool]  # per group, in the order given
    refusals: list[Refusal] = field(default_factory=list)
    checked: int = 0  # groups that went through the plausibility checks
    exact: int = 0  # groups compared with their own version's logprobs (version t ones included)
    unavailable: int = 0  # groups an exact check was wanted for, whose version's weights were not there
    remote: int = 0  # groups whose exact check a verifier daemon computed (learner/verifiers.py)
    choices: int = 0  # groups whose seeded choices were re-derived from their own version's logits
    refused: Counter[str] = field(default_factory=Counter)
    evidence: list[GroupEvidence] = field(default_factory=list)  # the groups measured under their own version

    def stats(self) -> dict[str, Any]:
        return {
            "refused_groups": [r.as_tuple() for r in self.refusals],
            "group_evidence": list(self.evidence),
            "verify_checked": self.checked,
            "verify_exact": self.exact,
            "verify_unavailable": self.unavailable,
            "verify_remote": self.remote,
            "verify_choices": self.choices,
            "verify_refused": dict(self.refused),
        }


@dataclass
class _Pending:
    """One group under check."""

    index: int
    group: Group
    rows: torch.Tensor  # its row indices in the batch (on the CPU)
    staleness: int
    reason: str | None = None
    detail: str = ""
    want_exact: bool = False
    exact_done: bool = False
    z: float = 0.0  # max of the group z and its sequences' z, under the best distribution available
    signed_z: float | None = None  # the group's z under its own version (None: only the proxy scored it)
    choice: float | None = None  # choice evidence of its positions, re-derived under its own version
    positions: int = 0  # positions re-derived
    gap: float | None = None  # the largest re-derived choice gap, nats of logits
    strayed: bool = False  # a re-derived choice strayed past suspect_fraction of δ: its peer becomes a suspect
    seeded: bool = False  # drawn with a sampler the learner knows, with the lease's seed: its choices are checked
    want_choices: bool = False  # its choices are checked against the step's own logits (version t)
    choices_done: bool = False  # its choices were checked under its own version's logits
    local: torch.Tensor | None = None  # its row indices within its version's exact forward


class Verifier:
    """Decides which groups of a batch may train (see the module docstring).

    >>> verifier = Verifier(VerifyConfig(), temperature=1.0, top_p=1.0, weights_of=store_weights,
    ...                     make_spare=lambda: fresh_model_like(policy))
    >>> with torch.no_grad():
    ...     scored = completion_logits(policy, ids, attn, comp, temperature=1.0)
    ...     scores = score_logits(scored)
    >>> result = verifier.check(groups, rows, current_version=7, input_ids=ids, attention_mask=attn,
    ...                         completion_mask=comp, behaviour=behaviour, scores=scores, logits=scored)
    >>> result.keep, result.refusals

    ``rows[i]`` lists the batch rows of ``groups[i]``. Not thread-safe: one step at a time.
    """

    def __init__(
        self,
        config: VerifyConfig,
        *,
        temperature: float,
        top_p: float = 1.0,
        weights_of: WeightsOf | None = None,
        make_spare: Callable[[], torch.nn.Module] | None = None,
        remote: RemoteCheck | None = None,
    ):
        self.config = config
        self.temperature = temperature
        self.top_p = top_p
        self.weights_of = weights_of
        self.make_spare = make_spare
        self.remote = remote  # computes an exact check's figures on a verifier daemon, or declines (None)
        self._spares: OrderedDict[int, torch.nn.Module] = OrderedDict()  # version -> loaded model, LRU order
        self._streamed: Streaming | None = None  # what older versions stream through, if make_spare gives one
        self._loose: torch.nn.Module | None = None  # a whole model made while finding that out, not yet loaded
        self._rng: random.Random = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self._suspects: dict[str, int] = {}  # peer id -> last check() that refused or doubted one of its groups
        self._seen: OrderedDict[str, int] = OrderedDict()  # peer id -> groups checked (newcomer_groups), LRU
        self._checks = 0

    # -- bounds ------------------------------------------------------------------------------
    def token_bound(self, staleness: int) -> float:
        return self.config.exact_tolerance + staleness * self.config.token_gap_per_version

    def mean_bound(self, staleness: int) -> float:
        return self.config.exact_mean_tolerance + staleness * self.config.mean_gap_per_version

    # -- the check ---------------------------------------------------------------------------
    def check(
        self,
        groups: Sequence[Group],
        rows: Sequence[Sequence[int]],
        *,
        current_version: int,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_mask: torch.Tensor,
        behaviour: torch.Tensor,
        scores: TokenScores,
        logits: CompletionLogits | None = None,
    ) -> VerifyResult:
        """``scores`` and ``logits`` come from the step's own forward at ``current_version`` (``logits``:
        its `completion_logits`; without them, seeded groups of that version are re-derived under its
        published weights instead, like older ones)."""
        self._checks += 1
        cfg = self.config
        device = input_ids.device
        mask = completion_mask.bool()
        pending = [
            _Pending(i, g, torch.as_tensor(list(r), dtype=torch.long), current_version - g.version)
            for i, (g, r) in enumerate(zip(groups, rows, strict=True))
        ]
        result = VerifyResult(keep=[True] * len(groups), checked=len(groups))
        if not pending:
            return result
        keys = self._keys(pending, input_ids.shape[0])

        # 1. Plausibility against q, the policy at version t as the engines report it (log of the
        # renormalised nucleus probability; the proximal logprob itself when top_p = 1), every group.
        # One transfer of per-row figures to the CPU for the whole batch, not one per group.
        finite = torch.isfinite(behaviour)
        claimed_ok = torch.where(mask, finite, torch.ones_like(mask)).all(dim=1)
        gap = torch.where(mask & finite, (behaviour - scores.sampling_logprobs).abs(), torch.zeros_like(behaviour))
        figures = torch.stack([claimed_ok.float(), gap.amax(dim=1), gap.sum(dim=1), mask.sum(dim=1).float()]).cpu()
        excess, variance = row_typicality(scores, mask)
        for p in pending:
            r = p.rows
            if p.staleness < 0:
                p.reason, p.detail = "future_version", f"v{p.group.version} > current v{current_version}"
                continue
            if not bool(figures[0, r].all()):
                p.reason, p.detail = "nonfinite_logprob", "a behaviour logprob is NaN or inf"
                continue
            max_gap = float(figures[1, r].max())
            mean_gap = float(figures[2, r].sum() / figures[3, r].sum().clamp(min=1))
            k = p.staleness
            if max_gap > self.token_bound(k) or not math.isfinite(max_gap):
                p.reason = "exact_mismatch" if k == 0 else "token_gap"
                p.detail = f"max |b - q| = {max_gap:.3g} > {self.token_bound(k):.3g} (staleness {k})"
            elif mean_gap > self.mean_bound(k):
                p.reason = "exact_mismatch" if k == 0 else "mean_gap"
                p.detail = f"mean |b - q| = {mean_gap:.3g} > {self.mean_bound(k):.3g} (staleness {k})"
            if p.reason is not None:
                # k > 0: the policy may have moved further than the per-version slack allows (several
                # updates a step, a high lr); k = 0: q comes from the fp32 masters, not the weights the
                # engines ran (the publish cast). Either way the group's own published version decides,
                # where the learner has it; the reason above stands only when it does not.
                p.want_exact = True
            if excess is not None:
                p.z = self._group_z(excess, variance, r)
                if k == 0:
                    p.signed_z = self._signed_z(excess, variance, r)
            if k == 0:
                p.exact_done = True  # q is version t's own logprob: this was the exact check
                if keys is not None and p.seeded and p.reason is None:
                    p.want_choices = logits is not None
                    p.want_exact = logits is None
            elif p.reason is None:
                p.want_exact = (
                    self._rng.random() < cfg.sample_fraction
                    or self._seen.get(p.group.peer_id, 0) < cfg.newcomer_groups
                    or max_gap > cfg.suspect_fraction * self.token_bound(k)
                    or mean_gap > cfg.suspect_fraction * self.mean_bound(k)
                    or p.z > cfg.typicality_z
                )
        refused_now = {p.group.peer_id for p in pending if p.reason is not None}
        for p in pending:
            if p.reason is None and p.staleness > 0 and (
                p.group.peer_id in refused_now
                or self._checks - self._suspects.get(p.group.peer_id, -(10**9)) <= cfg.suspect_steps
            ):
                p.want_exact = True

        # 1b. The seeded choices of version t's groups, from the step's own logits.
        chosen = [p for p in pending if p.want_choices]
        if chosen and logits is not None and keys is not None:
            rows_of = torch.cat([p.rows for p in chosen])
            self._judge_choices(chosen, choice_gaps_of(logits, completion_mask, keys, rows_of, top_p=self.top_p,
                                                       delta=self._delta, scale=self._scale))
            for p in chosen:
                if p.reason is not None:
                    p.want_exact = True  # judged under the masters: the published version decides

        # 2. Exact check of the chosen groups, one forward per version (here, or on a verifier daemon).
        by_version: dict[int, list[_Pending]] = {}
        for p in pending:
            if p.want_exact:
                by_version.setdefault(p.group.version, []).append(p)
        for version, members in sorted(by_version.items()):
            index = torch.cat([p.rows for p in members]).to(device)
            sub_keys = keys[index.cpu()] if keys is not None else None
            figures, remote = self._exact(version, input_ids[index], attention_mask[index], completion_mask[index],
                                          sub_keys)
            result.remote += len(members) if remote else 0
            if figures is None:
                result.unavailable += len(members)
                continue
            sub_mask = mask[index]
            exact_lp = figures.logprobs.to(device)
            sub_gap = torch.where(sub_mask, (behaviour[index] - exact_lp).abs(), torch.zeros_like(exact_lp))
            sub_excess, sub_variance = figures.excess, figures.variance
            sub_figures = torch.stack([sub_gap.amax(dim=1), sub_gap.sum(dim=1), sub_mask.sum(dim=1).float()]).cpu()
            start = 0
            for p in members:
                local = torch.arange(start, start + len(p.rows))
                p.local = local
                start += len(p.rows)
                p.exact_done = True
                p.reason, p.detail = None, ""  # a failed proxy check is superseded by the exact one
                max_gap = float(sub_figures[0, local].max())
                mean_gap = float(sub_figures[1, local].sum() / sub_figures[2, local].sum().clamp(min=1))
                if max_gap > cfg.exact_tolerance:
                    p.reason = "exact_mismatch"
                    p.detail = f"v{version}: max |b - e| = {max_gap:.3g} > {cfg.exact_tolerance:.3g}"
                elif mean_gap > cfg.exact_mean_tolerance:
                    p.reason = "exact_mismatch"
                    p.detail = f"v{version}: mean |b - e| = {mean_gap:.3g} > {cfg.exact_mean_tolerance:.3g}"
                if sub_excess is not None and sub_variance is not None:
                    p.z = self._group_z(sub_excess, sub_variance, local)  # under the behaviour version itself
                    p.signed_z = self._signed_z(sub_excess, sub_variance, local)
            seeded = [p for p in members if p.seeded and p.reason is None]
            if seeded and keys is not None:
                at = torch.cat([p.local for p in seeded])
                self._judge_choices(seeded, ChoiceGaps(figures.gap[at], figures.outside[at], figures.evidence[at],
                                                       figures.positions[at]), f"v{version}: ")

        # 3. Typicality, under the behaviour version where it was scored, else under q (a proxy).
        if cfg.typicality_z is not None:
            for p in pending:
                if p.reason is None and p.z > cfg.typicality_z:
                    p.reason = "atypical_text"
                    p.detail = (f"typicality z = {p.z:.1f} > {cfg.typicality_z:g} under "
                                + (f"v{p.group.version}" if p.exact_done else f"v{current_version} (proxy)"))

        for p in pending:
            result.exact += int(p.exact_done)
            result.choices += int(p.choices_done)
            peer = p.group.peer_id
            self._seen[peer] = self._seen.pop(peer, 0) + 1
            if len(self._seen) > 10_000:  # bounded: a forgotten peer is checked as a newcomer again
                self._seen.popitem(last=False)
            if p.strayed:
                self._suspects[peer] = self._checks
            if p.choice is not None or p.signed_z is not None:
                result.evidence.append(GroupEvidence(peer, p.group.prompt_id, p.positions, p.choice, p.signed_z,
                                                     p.gap))
            if p.reason is not None:
                result.keep[p.index] = False
                result.refused[p.reason] += 1
                result.refusals.append(Refusal(p.group.peer_id, p.group.prompt_id, p.reason, p.detail))
                self._suspects[p.group.peer_id] = self._checks
                logger.warning("refused group %s from peer %s (v%d at v%d): %s: %s", p.group.prompt_id,
                               p.group.peer_id[-8:] or "?", p.group.version, current_version, p.reason, p.detail)
        if len(self._suspects) > 10_000:  # bounded: forget the peers refused longest ago
            self._suspects = {peer: n for peer, n in self._suspects.items() if self._checks - n <= cfg.suspect_steps}
        return result

    # -- seeded choices ------------------------------------------------------------------------
    def _keys(self, pending: list[_Pending], batch: int) -> torch.Tensor | None:
        """``[B, 2]`` int64 (on the CPU): the key words of every row of a seeded group (others 0);
        None when no group of the batch is seeded."""
        keys: torch.Tensor | None = None
        for p in pending:
            g = p.group
            if g.sampler not in SAMPLERS or g.seed is None:
                continue
            if keys is None:
                keys = torch.zeros((batch, 2), dtype=torch.long)
            p.seeded = True
            keys[p.rows] = torch.tensor([completion_key(g.seed, g.prompt_id, j) for j in range(len(p.rows))],
                                        dtype=torch.long)
        return keys

    @property
    def _delta(self) -> float:
        """δ in the units of the scores (logits / T): how far an honest engine's logits may differ from ours."""
        return self.config.sample_tolerance / self.temperature

    @property
    def _scale(self) -> float:
        return self.config.peer_choice_scale / self.temperature

    def _judge_choices(self, members: list[_Pending], found: ChoiceGaps, where: str = "") -> None:
        """Refuse as `sample_mismatch` the members whose tokens the seeded sampler cannot have chosen
        (``found``: the re-derived choices of the members' rows, in order)."""
        delta = self._delta
        figures = torch.stack([found.gap.float(), found.outside.float(), found.evidence.float(),
                               found.positions.float()]).cpu()
        start = 0
        for p in members:
            local = slice(start, start + len(p.rows))
            start += len(p.rows)
            p.choices_done = True
            worst = float(figures[0, local].max())
            p.choice, p.positions = float(figures[2, local].sum()), int(figures[3, local].sum())
            p.gap = max(0.0, worst) * self.temperature if p.positions else None
            p.strayed = worst > self.config.suspect_fraction * delta
            if bool(figures[1, local].any()):
                p.reason = "sample_mismatch"
                p.detail = f"{where}a sent token outside the nucleus (δ / T = {delta:.3g})"
            elif worst > delta:
                p.reason = "sample_mismatch"
                p.detail = (f"{where}a sent token's perturbed score {worst:.3g} below the sampler's choice "
                            f"(δ / T = {delta:.3g})")

    @staticmethod
    def _signed_z(excess: torch.Tensor, variance: torch.Tensor, rows: torch.Tensor) -> float:
        """The group's z, signed: below 0 when its text is more probable than sampling gives (colder)."""
        return float(excess[rows].sum() / torch.sqrt(variance[rows].sum() + VARIANCE_FLOOR))

    @staticmethod
    def _group_z(excess: torch.Tensor, variance: torch.Tensor, rows: torch.Tensor) -> float:
        """The larger of the group's z and its sequences' z (see `typicality_z`)."""
        e, v = excess[rows], variance[rows]
        per_row = e / torch.sqrt(v + VARIANCE_FLOOR)
        group = e.sum() / torch.sqrt(v.sum() + VARIANCE_FLOOR)
        return float(torch.maximum(per_row.max(), group))

    # -- older versions ------------------------------------------------------------------------
    def _exact(self, version: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               completion_mask: torch.Tensor, keys: torch.Tensor | None) -> tuple[ExactFigures | None, bool]:
        """Version ``version``'s figures for these rows, and whether `remote` computed them (a verifier
        daemon); else the version's forward here; None when neither has the version."""
        settings = ExactSettings(self.temperature, self.top_p, self.config.typicality_z is not None, self._delta,
                                 self._scale)
        if self.remote is not None:
            try:
                figures = self.remote(version, input_ids, attention_mask, completion_mask, keys, settings,
                                      self._need_bytes(input_ids.shape[0], input_ids.shape[1]))
            except CheckUnavailable as e:
                logger.warning("verify: exact check of v%d unavailable: %s", version, e)
                return None, False
            if figures is not None:
                return figures, True
        with self._version_model(version) as model, torch.no_grad():
            if model is None:
                return None, False
            return exact_figures(model, input_ids, attention_mask, completion_mask, keys, settings), False

    def _need_bytes(self, rows: int, length: int) -> int:
        """What a forward here would hold: the streamed model's buffers and a few copies of the logits."""
        self._make_spare_once()
        spare = self._streamed if self._streamed is not None else self._loose
        held = int(getattr(spare, "buffer_bytes", 0) or 0)
        config = getattr(getattr(spare, "inner", spare), "config", None)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        return held + 3 * 4 * rows * length * vocab

    def _make_spare_once(self) -> None:
        """What older versions run through, made the first time one is needed: something `Streaming`
        (kept in `_streamed`), or a whole model not yet loaded (`_loose`, the first of `_spares`)."""
        if self.make_spare is None or self._streamed is not None or self._loose is not None or self._spares:
            return
        spare = self.make_spare()
        if isinstance(spare, Streaming):
            self._streamed = spare
        else:
            self._loose = spare

    @contextmanager
    def _version_model(self, version: int) -> Iterator[torch.nn.Module | None]:
        """A model computing version ``version``'s logits within the block, or None when its weights are
        not available. `make_spare` gives either something `Streaming` (the trainers: the version's
        weights read module by module during each forward, none kept) or a model to load whole (the
        benchmarks' baseline: `spare_models` of them kept, least recently used reloaded)."""
        if self.weights_of is None or self.make_spare is None:
            yield None
            return
        self._make_spare_once()
        if self._streamed is None:
            yield self._loaded(version)
            return
        weights = self._weights(version, streamed=True)
        with ExitStack() as stack:
            try:
                model = stack.enter_context(self._streamed.use(weights)) if weights is not None else None
            except ValueError as e:
                logger.warning("verify: weights of v%d do not fit the policy: %s", version, e)
                model = None
            yield model

    def _weights(self, version: int, *, streamed: bool) -> Any:
        try:
            weights = self.weights_of(version) if self.weights_of is not None else None
            if weights is None:
                return None
            if isinstance(weights, VersionWeights):  # headers already read (the sharded trainer's rank 0)
                return weights if streamed else _read_model_dir(weights.dir)
            if streamed:
                return VersionWeights(weights) if isinstance(weights, (str, Path)) else TensorWeights(weights)
            return _read_model_dir(Path(weights)) if isinstance(weights, (str, Path)) else weights
        except Exception as e:  # a store mid-collection, a file gone or damaged: no exact check, not a crash
            logger.warning("verify: weights of v%d unavailable (%s: %s)", version, type(e).__name__, e)
            return None

    def _loaded(self, version: int) -> torch.nn.Module | None:
        """A whole model holding version ``version``'s weights (LRU of `spare_models`), or None."""
        if version in self._spares:
            self._spares.move_to_end(version)
            return self._spares[version]
        weights = self._weights(version, streamed=False)
        if weights is None:
            return None
        if len(self._spares) >= max(1, self.config.spare_models):
            _, model = self._spares.popitem(last=False)  # reuse the least recently used copy's memory
        elif self._loose is not None:
            model, self._loose = self._loose, None
        else:
            model = self.make_spare()  # type: ignore[misc]
        model.requires_grad_(False)
        model.eval()
        try:
            load_policy_weights(model, weights)
        except ValueError as e:
            logger.warning("verify: weights of v%d do not fit the policy: %s", version, e)
            return None
        self._spares[version] = model
        return model


def _read_model_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file, device="cpu"))
    if not tensors:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return tensors

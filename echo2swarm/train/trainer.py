"""One GRPO step on a batch of accepted groups, and the weights it produces.

    groups (prompt ids, completions, behaviour logprobs, rewards, version)
      ─► left-padded batch ─► advantages per group                      (batches.py)
      ─► ONE forward: token logprobs (with grad); detached, the proximal logprobs, plus the
         sampling statistics of the verification (verify.py)
      ─► verification: implausible, mis-versioned or atypical groups, and those whose tokens the
         lease's seeded sampler would not have chosen, leave the objective, reported
      ─► clipped objective (decoupled PPO when some groups are stale) ─► AdamW step,
         skipped when the loss or the gradient norm is not finite          (updates.py)

Weights are turned into bytes (`weights_bytes`, what the learner signs and publishes) only when
every tensor is finite.

Runs in a worker thread of the learner daemon; nothing here touches the network. The policy, the
reference model, the optimizer state and every batch tensor live on `train.device`; published
weights and model directories are fp32 on the CPU wherever training runs.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.train.batches import Batch, build_batch, group_rows
from echo2swarm.train.exact import RemoteCheck
from echo2swarm.train.group import Group
from echo2swarm.train.grpo import completion_logits
from echo2swarm.train.rounding import ROUND_TO_NEAREST, held_cast
from echo2swarm.train.scoring import score_logits
from echo2swarm.train.streamed import StreamedPolicy
from echo2swarm.train.updates import UpdatePath, merge_updates
from echo2swarm.train.verify import (
    NonFiniteWeightsError,
    Verifier,
    VerifyResult,
    WeightsOf,
    check_finite,
    load_policy_weights,
)
from echo2swarm.runtime.devices import resolve_device
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

__all__ = ["GRPOTrainer", "NonFiniteWeightsError", "train_without_dropout", "unique_state_dict"]

_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
             torch.nn.FeatureAlphaDropout)


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without tied duplicates (safetensors refuses shared storage)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.detach().contiguous()
    return out


def train_without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in training mode with every dropout probability set to 0.

    The policy's logprobs are what the step scores, verifies and clips against, and what rollout
    peers sample with (in eval mode): a forward with dropout would make the proximal logprobs noise,
    the first update's ratio differ from 1, and honest groups fail verification. Training mode
    stays on because activation checkpointing acts only there. Dropout modules get ``p = 0``, and
    float attributes named ``*dropout*`` (Hugging Face attention keeps its probability there) 0.0.
    """
    for module in model.modules():
        if isinstance(module, _DROPOUTS):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model.train()


class GRPOTrainer(UpdatePath):
    """Holds the policy and its optimizer.

    >>> trainer = GRPOTrainer(Path("model"), TrainConfig(), verify=VerifyConfig(),
    ...                       weights_of=lambda v: store.dir(v) if store.installed(v) else None)
    >>> stats = trainer.step(groups, current_version=7)
    >>> stats["refused_groups"]                # [(peer_id, prompt_id, reason), ...]
    >>> weights = trainer.weights_bytes()      # safetensors bytes for the next version

    ``verify`` (default: ``VerifyConfig()``, checks on) configures the checks of train/verify.py;
    ``weights_of(version)`` gives the weights of a version the learner published (tensors by name,
    or its model directory), None when gone. Without it, groups older than the step's version get
    the plausibility and typicality checks but no exact check.
    """

    rank = 0   # this process's rank among the learner's ranks (train/distributed.py)
    world = 1  # ranks training the policy together; each takes every world-th micro-batch

    def __init__(self, model_dir: Path, config: TrainConfig, *, verify: VerifyConfig | None = None,
                 weights_of: WeightsOf | None = None, remote: RemoteCheck | None = None):
        self.config = config
        self.verify_config = verify if verify is not None else VerifyConfig()
        self.device = self._resolve_device()
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = self._load_policy()  # on the device before the optimizer, so its state is created there
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                           betas=(config.adam_beta1, config.adam_beta2))
        self.reference = self._load_reference() if config.kl_coef > 0 else None
        self.verifier: Verifier | None = None
        if self.verify_config.enabled:
            self.verifier = Verifier(self.verify_config, temperature=config.temperature, top_p=config.top_p,
                                     weights_of=weights_of, make_spare=self._verify_spare, remote=remote)
        self.skipped_nonfinite = 0  # updates skipped so far because the loss or a gradient was not finite

    # -- building (train/distributed.py's ShardedTrainer overrides these) ----------------------
    def _resolve_device(self) -> torch.device:
        return resolve_device(self.config.device, setting="train.device (--device)")

    def _load_policy(self) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        if self.config.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = train_without_dropout(model.to(self.device))
        logger.info("trainer: %s on %s (%d params, fp32)", self.model_dir, self.device,
                    sum(p.numel() for p in model.parameters()))
        return model

    def _load_reference(self) -> torch.nn.Module:
        reference = copy.deepcopy(self.model).eval()
        reference.requires_grad_(False)
        return reference

    def _verify_spare(self) -> torch.nn.Module:
        """What the verifier computes older versions' logits with: the policy's skeleton, their
        weights read from disk module by module during each forward, none kept (train/streamed.py)."""
        return StreamedPolicy(self.model)

    def _spare_model(self) -> torch.nn.Module:
        """A whole second copy of the policy on the training device (tools and the benchmarks' baseline
        for the verifier; the verifier itself streams older versions: `_verify_spare`).

        A copy of the module (a device-side copy, no random initialisation), without gradients:
        they are set aside while it is made and put back after.
        """
        params = list(self.model.parameters())
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            spare = copy.deepcopy(self.model)
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad
        spare.requires_grad_(False)
        return spare.eval()

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every end-of-sequence id the generation config or tokenizer names (engines stop on any)."""
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else list(value or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def build_batch(self, groups: list[Group]) -> Batch:
        return build_batch(groups, pad_id=self.pad_id, scale_std=self.config.scale_std, device=self.device)

    _group_rows = staticmethod(group_rows)

    def step(self, groups: list[Group], current_version: int) -> dict[str, Any]:
        """One GRPO step on ``groups`` (trained at policy version ``current_version``).

        Returns float stats of the objective averaged over the step's optimizer updates (``loss``,
        ``ratio_mean``, ``kl``, ``is_weight_mean``, ``is_truncated_frac``, ``is_masked_frac``,
        ``is_ess``, ``offpolicy_gap_mean``; ``offpolicy_gap_max`` is the max; ``clip_frac`` is the mean
        over the updates after the first, which never clips: see `merge_updates`),
        ``grad_norm`` (mean), ``updates``, rewards and sizes of what trained, ``t_train_s``, and:
        ``refused_groups`` [(peer_id, prompt_id, reason)], ``verify_checked``, ``verify_exact``,
        ``verify_unavailable``, ``verify_choices``, ``verify_refused`` {reason: n}, ``t_verify_s``,
        ``offpolicy_dropped``, ``groups_trained``, and ``skipped_nonfinite`` (updates not made because
        the loss or the gradient norm was not finite). A batch whose every group is refused trains nothing
        (``groups_trained`` 0, ``loss`` 0.0, no optimizer step).

        The first forward of the policy gives the proximal logprobs (the policy before this step's
        first update), the verification's reference and the off-policy gap. When the first update
        takes the whole batch (``minibatches == 1``, one process, no micro-batches) that forward, with
        gradient, is also the first update's: the step then makes ``ppo_epochs`` forwards, not one
        more. Otherwise it runs without gradient and each minibatch has its own forward and update.
        Later updates are clipped against the proximal policy.
        """
        started = time.perf_counter()
        config = self.config
        batch = self.build_batch(groups)
        rows = self._group_rows(groups)
        parts = min(config.minibatches, len(groups))  # minibatches a pass makes
        one_update = config.ppo_epochs * parts == 1
        # The first update's forward is the proximal one too when that update takes the whole batch in
        # one forward (one minibatch, one process, no micro-batches).
        fused = parts == 1 and self.world == 1 and config.micro_batch_sequences is None
        with torch.set_grad_enabled(fused):
            scored = completion_logits(self.model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                       temperature=config.temperature)
            logprobs = scored.token_logprobs()
        proximal = logprobs.detach()
        verdict = VerifyResult(keep=[True] * len(groups))
        t_verify = 0.0
        if self.verifier is not None:
            verify_started = time.perf_counter()
            scores = score_logits(scored, top_p=config.top_p, logprobs=proximal,
                                  typicality=self.verify_config.typicality_z is not None)
            with torch.no_grad():
                verdict = self.verifier.check(
                    groups, rows, current_version=current_version,
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    completion_mask=batch.completion_mask, behaviour=batch.behaviour, scores=scores, logits=scored,
                )
            t_verify = time.perf_counter() - verify_started
        del scored
        keep = list(verdict.keep)
        offpolicy_dropped = self._drop_offpolicy(groups, rows, keep, proximal, batch)
        verify_stats = {**verdict.stats(), "t_verify_s": t_verify, "offpolicy_dropped": offpolicy_dropped,
                        "groups_trained": sum(keep)}
        if not all(keep):
            # Refused rows stay in the tensors but leave the objective: masked positions
            # contribute nothing to grpo_loss, whatever they hold (inf and NaN included).
            keep_rows = torch.tensor([k for g, k in zip(groups, keep) for _ in g.completions],
                                     dtype=torch.bool, device=self.device)
            batch = batch.only_rows(keep_rows)
        kept_groups = [(g, r) for g, r, k in zip(groups, rows, keep) if k]
        if not kept_groups:
            logger.warning("step at v%d: every group was refused; nothing to train", current_version)
            return self._idle_stats(verify_stats, started)

        kept = batch.completion_mask.bool().any(dim=1)
        stale_rows = kept & (batch.versions < current_version)
        # Decoupled PPO (clip against the proximal policy, re-weight by the behaviour importance
        # weight) when some groups are stale, the step makes several updates, or tokens were drawn
        # from a top-p nucleus (the behaviour logprob is then the renormalised one, not the policy's).
        decoupled = bool(stale_rows.any()) or not one_update or config.top_p < 1.0
        rows_kept = [r for _, r in kept_groups]
        if fused:
            step_tokens = float(batch.completion_mask.sum())
            updates = [self._objective(logprobs, proximal if decoupled else None, batch, step_tokens, current_version)]
            del logprobs
            updates += self._minibatch_updates(batch, proximal, rows_kept, current_version, decoupled=decoupled,
                                               first_done=True)
        else:
            del logprobs
            updates = self._minibatch_updates(batch, proximal, rows_kept, current_version, decoupled=decoupled)
        trained = [g for g, _ in kept_groups]
        rewards = torch.tensor([r for g in trained for r in g.rewards])
        return {
            **merge_updates(updates),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "tokens": int(batch.completion_mask.sum()),
            "sequences": int(kept.sum()),
            "stale_sequences": int(stale_rows.sum()),
            **verify_stats,
            "t_train_s": time.perf_counter() - started,
        }

    def weights_state(self, dtype: torch.dtype | None = None, hold_from: dict[str, torch.Tensor] | None = None,
                      hold_ulps: float = ROUND_TO_NEAREST) -> dict[str, torch.Tensor]:
        """The policy's tensors on the CPU, cast to ``dtype`` (None: the fp32 master weights).

        The cast is what a version publishes: what peers run and what their logprobs are measured
        against. With ``hold_from`` (the previous version's tensors), values within ``hold_ulps`` of
        theirs are kept (train/rounding.py). Raises NonFiniteWeightsError (a ValueError) when any
        tensor holds a NaN or an inf, after the cast (fp32 values beyond float16's range become
        inf): such weights are never turned into bytes, so never signed, published or checkpointed.
        """
        hold_from = (hold_from or {}) if hold_ulps > ROUND_TO_NEAREST else {}

        def published(name: str, t: torch.Tensor) -> torch.Tensor:
            if dtype is None or name not in hold_from:  # cast on the way to the CPU, not after an fp32 copy
                return t.to("cpu", dtype or t.dtype)
            return held_cast(t.to("cpu"), hold_from[name], dtype, hold_ulps)

        state = {name: published(name, t) for name, t in unique_state_dict(self.model).items()}
        check_finite(state)
        return state

    def weights_bytes(self, dtype: torch.dtype | None = None) -> bytes:
        """`weights_state(dtype)` as safetensors bytes (NonFiniteWeightsError if not finite)."""
        return save_safetensors(self.weights_state(dtype), metadata={"format": "pt"})

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        # load_state_dict copies into the existing parameters, so CPU tensors land on self.device.
        # Names sharing storage with another (lm_head tied to the embeddings) are not in saved weights.
        try:
            load_policy_weights(self.model, tensors)
        except ValueError as e:
            raise ValueError(f"checkpoint does not fit the model: {e}") from None

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments (after a roll-back to a published version: they went non-finite too)."""
        self.optimizer.state.clear()

    def assert_finite(self) -> None:
        """NonFiniteWeightsError when any weight holds a NaN or an inf (before a checkpoint)."""
        check_finite(unique_state_dict(self.model))

    def save_state(self, path: Path) -> None:
        """The policy and its AdamW state as a torch.distributed.checkpoint directory at ``path``:
        names as in the unsharded model, so any number of ranks (or one process) loads it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))

    def load_state(self, path: Path) -> None:
        """Load what `save_state` wrote, whatever number of ranks wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def close(self) -> None:
        """Nothing to release in one process (a sharded trainer stops its other ranks)."""

    def save_model_dir(self, out_dir: Path) -> Path:
        """A plain Hugging Face model directory of the current policy (NonFiniteWeightsError if not finite)."""
        check_finite(unique_state_dict(self.model))
        self.model.save_pretrained(out_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir

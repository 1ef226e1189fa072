"""GRPO maths: group advantages, per-token logprobs, and the loss docs/architecture.md §7 defines.

Pure torch, no I/O. The learner daemon turns buffered groups into padded tensors and calls::

    adv = torch.cat([group_advantages(torch.tensor(g.rewards)) for g in groups])   # [B]
    scored = completion_logits(model, ids, attn, comp_mask)                       # one forward
    lp = scored.token_logprobs()                                                  # [B, L], with grad
    proximal = lp.detach()                   # the policy before this step (= a no_grad forward)
    loss, stats = grpo_loss(lp, behaviour, adv, comp_mask, proximal_logprobs=proximal)
    loss.backward()

(`token_logprobs(model, ...)` is the same in one call; verify.py scores ``scored``'s logits too.)

Sign convention: ``grpo_loss`` is a loss to *minimise*; a positive advantage pushes the
logprobs of that sequence's tokens up. Every per-token tensor is ``[B, L]`` and aligned with
``input_ids``: position ``t`` holds the logprob of token ``t`` (not of token ``t + 1``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import get_args

import torch

from echo2swarm.config.rl import IsLevel, IsMode, KlEstimator, LossType, TrainConfig

__all__ = ["CompletionLogits", "ImportanceWeights", "LossOptions", "completion_logits", "group_advantages", "grpo_loss",
           "importance_weights", "token_logprobs"]


def group_advantages(rewards: torch.Tensor, *, scale_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages of one group: ``r_i - mean(r)``, divided by ``std(r) + eps`` when ``scale_std``.

    ``rewards`` is ``[G]`` (or ``[..., G]``: each row along the last dim is one group). The std is
    the sample std (Bessel-corrected, as TRL and verl compute it) and ``eps`` keeps a group whose
    rewards differ by a hair from turning into huge advantages. A group whose rewards are all
    equal carries no learning signal and gets exact zeros, not ``rounding error / eps``.
    """
    rewards = torch.as_tensor(rewards)
    if rewards.ndim == 0:
        raise ValueError("rewards must have at least one dimension (the group)")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    flat = (rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True))
    if scale_std and rewards.shape[-1] > 1:
        centred = centred / (rewards.std(dim=-1, unbiased=True, keepdim=True) + eps)
    return torch.where(flat, torch.zeros_like(centred), centred)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class CompletionLogits:
    """The temperature-scaled logits that predict the completion tokens of a left-padded batch.

    ``logits[:, j]`` (``[B, L - first, V]``, float32, already divided by the temperature) is the
    prediction for token ``first + j`` of ``input_ids``; ``targets[:, j]`` is that token. ``keep``
    (``[B, L]`` bool) marks the positions whose logprob is wanted (the completion mask without
    position 0). When nothing is to be scored, ``logits`` has no columns.
    """

    logits: torch.Tensor
    targets: torch.Tensor
    first: int
    keep: torch.Tensor

    def token_logprobs(self) -> torch.Tensor:
        """``[B, L]``: ``log softmax(logits)[target]`` where ``keep`` is set, else 0."""
        return self.spread(self.picked_logprobs())

    def picked_logprobs(self) -> torch.Tensor:
        """``[B, L - first]``: the target's logprob at every scored column (padding included)."""
        if self.logits.shape[1] == 0:
            return self.logits.new_zeros(self.targets.shape)
        picked = self.logits.gather(-1, self.targets.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(self.logits, dim=-1)

    def spread(self, columns: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Place ``[B, L - first]`` values back at their ``[B, L]`` positions; ``fill`` where not kept."""
        batch, length = self.keep.shape
        head = columns.new_full((batch, length - columns.shape[1]), fill)
        out = torch.cat([head, columns], dim=1)
        # `where`, not `*`: a NaN from a fully padded row must not leak through 0 * NaN.
        return torch.where(self.keep, out, torch.full_like(out, fill))


def completion_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> CompletionLogits:
    """One forward of ``model`` over a left-padded ``[B, L]`` batch, keeping only the logits that
    predict completion tokens (see :class:`CompletionLogits`). Gradients flow unless the caller
    wraps the call in ``torch.no_grad()``.

    Memory: only the positions from the first completion token on get logits (via
    ``logits_to_keep`` on Hugging Face causal LMs).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape or completion_mask.shape != input_ids.shape:
        raise ValueError(
            "input_ids, attention_mask and completion_mask must all be [B, L]; got "
            f"{tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, {tuple(completion_mask.shape)}"
        )
    batch, length = input_ids.shape
    keep_mask = completion_mask.bool().clone()  # .bool() on a bool tensor aliases the caller's
    if length:
        keep_mask[:, 0] = False  # no prefix to condition on
    columns = keep_mask.any(dim=0).nonzero()
    if batch == 0 or length < 2 or columns.numel() == 0:
        empty = torch.zeros(batch, 0, 0, dtype=torch.float32, device=input_ids.device)
        return CompletionLogits(empty, input_ids[:, length:], length, keep_mask)
    first = int(columns[0])  # first position whose logprob is needed; its logits sit at first - 1
    n_keep = length - first + 1

    # Qwen3 (and other RoPE models) number positions 0..L-1 regardless of padding; with left
    # padding that shifts every prompt, so count only real tokens.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    kwargs: dict[str, object] = {"use_cache": False}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = n_keep
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs).logits
    logits = logits[:, -n_keep:-1].float()  # predictions for positions first .. L-1
    if temperature != 1.0:
        logits = logits / temperature
    return CompletionLogits(logits, input_ids[:, first:], first, keep_mask)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of each token given its prefix under ``softmax(logits / temperature)``, as ``[B, L]``.

    ``input_ids``/``attention_mask``/``completion_mask`` are ``[B, L]`` (prompt + completion, left
    padded). ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` where ``completion_mask`` is
    set, else 0; position 0 has no prefix and is always 0. Gradients flow unless the caller
    wraps the call in ``torch.no_grad()``.

    Memory: only the positions from the first completion token on get logits (via
    ``logits_to_keep`` on Hugging Face causal LMs), and the log-softmax is never materialised:
    the picked logit minus ``logsumexp`` over the vocabulary gives the same value.
    """
    return completion_logits(
        model, input_ids, attention_mask, completion_mask, temperature=temperature
    ).token_logprobs()


def _config_default(name: str) -> object:
    return TrainConfig.model_fields[name].default


@dataclass(frozen=True)
class LossOptions:
    """The knobs of :func:`grpo_loss`, each the `[train]` field of its name; docs/architecture.md §7
    says what each computes. Defaults are the config's.

    >>> options = LossOptions.from_config(config, global_tokens=step_tokens / minibatches)
    """

    loss_type: LossType = _config_default("loss_type")
    is_mode: IsMode = _config_default("is_mode")
    is_level: IsLevel = _config_default("is_level")
    is_cap: float | None = _config_default("is_cap")  # None: no cap (tests)
    clip_low: float = _config_default("clip_low")
    clip_high: float = _config_default("clip_high")
    kl_coef: float = _config_default("kl_coef")
    kl_estimator: KlEstimator = _config_default("kl_estimator")
    max_completion_length: int | None = None  # dr_grpo's constant: train.max_new_tokens
    global_tokens: float | None = None  # dapo's normaliser: the step's completion tokens / its minibatches

    @classmethod
    def from_config(cls, config: TrainConfig, *, global_tokens: float | None = None) -> LossOptions:
        return cls(loss_type=config.loss_type, is_mode=config.is_mode, is_level=config.is_level,
                   is_cap=config.is_cap, clip_low=config.clip_low, clip_high=config.clip_high,
                   kl_coef=config.kl_coef, kl_estimator=config.kl_estimator,
                   max_completion_length=config.max_new_tokens, global_tokens=global_tokens)

    def __post_init__(self) -> None:
        for name, allowed in (("loss_type", LossType), ("is_mode", IsMode), ("is_level", IsLevel),
                              ("kl_estimator", KlEstimator)):
            if getattr(self, name) not in get_args(allowed):
                raise ValueError(f"{name} must be one of {get_args(allowed)}, got {getattr(self, name)!r}")
        if self.loss_type == "dr_grpo" and not (self.max_completion_length and self.max_completion_length > 0):
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length > 0 (train.max_new_tokens)")
        if self.loss_type == "dapo" and not (self.global_tokens and self.global_tokens > 0):
            raise ValueError("loss_type 'dapo' needs global_tokens > 0 (the step's completion tokens)")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip_low and clip_high must be >= 0, got {self.clip_low}, {self.clip_high}")
        if self.is_cap is not None and self.is_cap <= 0:
            raise ValueError(f"is_cap must be > 0 or None, got {self.is_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    options: LossOptions | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO objective of docs/architecture.md §7, a loss to minimise, and its stats.

    ``logprobs`` ``[B, T]``: the current policy π, with grad. ``behaviour_logprobs``: the policy μ that
    sampled the tokens (the rollout peer's). ``advantages``: ``[B]`` (one per sequence) or ``[B, T]``.
    ``mask``: 1 on completion tokens; masked positions never matter, whatever they hold (inf and NaN
    included). ``proximal_logprobs``: the policy at the step's start (decoupled PPO: clip against it,
    weight by it over μ); None: clip against μ, no weights. ``ref_logprobs``: the reference policy's,
    for the KL term (reported as ``kl``; in the loss when ``options.kl_coef > 0``).

    Stats: ``loss``; ``clip_frac`` (tokens whose clipped branch is the smaller objective);
    ``ratio_mean``; ``kl`` (0.0 without a reference); ``is_weight_mean`` (of the weights applied, over
    the tokens they apply to; 1.0 without proximal logprobs); ``is_truncated_frac`` /
    ``is_masked_frac`` (tokens whose weight was cut / zeroed at the cap); ``is_ess`` (effective sample
    size of the uncapped weights, ``(Σw)² / (n Σw²)``, 1.0 when all are equal);
    ``offpolicy_gap_mean`` / ``offpolicy_gap_max`` (of ``|proximal - behaviour|`` per token).
    """
    options = options or LossOptions()
    keep, advantages = _checked(logprobs, behaviour_logprobs, advantages, mask, proximal_logprobs, ref_logprobs,
                                options)
    behaviour = behaviour_logprobs.detach()
    base = (behaviour if proximal_logprobs is None else proximal_logprobs).detach()
    weights = None if proximal_logprobs is None else importance_weights(base - behaviour, keep, options)
    token_loss, ratio, clipped = _clipped(logprobs, base, advantages, keep, options)
    if weights is not None:
        token_loss = token_loss * weights.applied
    loss = _aggregate(token_loss, keep, options)
    kl = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None:
        kl = _kl_term(logprobs, behaviour, ref_logprobs.detach(), keep, options)
        if options.kl_coef > 0:
            loss = loss + options.kl_coef * kl
    stats = {"loss": float(loss.detach()), "kl": float(kl.detach()),
             **_step_stats(ratio, clipped, base - behaviour, keep), **_weight_stats(weights, keep, options)}
    return loss, stats


def _checked(logprobs: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             proximal: torch.Tensor | None, ref: torch.Tensor | None, options: LossOptions
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes checked; returns the bool mask and ``[B, 1]`` or ``[B, T]`` detached advantages."""
    shape = logprobs.shape
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got {tuple(shape)}")
    for name, tensor in (("behaviour_logprobs", behaviour), ("mask", mask), ("proximal_logprobs", proximal),
                         ("ref_logprobs", ref)):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} like logprobs")
    if advantages.ndim == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages has {advantages.shape[0]} entries for a batch of {shape[0]}")
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != shape:
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)}")
    if options.kl_coef > 0 and ref is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    return mask.bool(), advantages.detach().to(logprobs.dtype)


@dataclass
class ImportanceWeights:
    """Step 1: each token's weight of the proximal over the behaviour policy (``[B, T]``, no gradient).

    ``log_raw``: the uncapped log weight at ``options.is_level``; ``over``: kept tokens above the cap;
    ``applied``: what multiplies the token losses (capped or zeroed above the cap, 0 where masked)."""

    log_raw: torch.Tensor
    over: torch.Tensor
    applied: torch.Tensor


def importance_weights(gap: torch.Tensor, keep: torch.Tensor, options: LossOptions) -> ImportanceWeights:
    """``gap`` = log(proximal / behaviour) per token -> the weights of docs/architecture.md §7."""
    gap = torch.where(keep, gap, torch.zeros_like(gap))
    if options.is_level == "token":
        log_raw = gap
    elif options.is_level == "sequence":
        log_raw = (gap.sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(gap)
    else:  # sequence_product
        log_raw = gap.sum(dim=1, keepdim=True).expand_as(gap)
    zeros = torch.zeros_like(gap)
    if options.is_cap is None:
        over = torch.zeros_like(keep)
        return ImportanceWeights(log_raw, over, torch.where(keep, torch.exp(log_raw), zeros))
    log_cap = math.log(options.is_cap)
    over = keep & (log_raw > log_cap)
    capped = torch.exp(log_raw.clamp(max=log_cap))  # never inf, so never inf x 0 in the backward
    cut = torch.full_like(gap, options.is_cap) if options.is_mode == "truncate" else zeros
    return ImportanceWeights(log_raw, over, torch.where(over, cut, torch.where(keep, capped, zeros)))


def _clipped(logprobs: torch.Tensor, base: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor,
             options: LossOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: the PPO token loss ``-min(r A, clip(r) A)`` with ``r = exp(logprobs - base)``; also
    returns ``r`` and where the clipped branch is the smaller objective."""
    # Zero the log-ratio on masked positions *before* exp: padding garbage gives neither inf nor NaN.
    ratio = torch.exp(torch.where(keep, logprobs - base, torch.zeros_like(logprobs)))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - options.clip_low, 1.0 + options.clip_high) * advantages
    return -torch.minimum(unclipped, clipped), ratio, (clipped < unclipped).detach()


def _aggregate(values: torch.Tensor, keep: torch.Tensor, options: LossOptions) -> torch.Tensor:
    """Step 3: one scalar from ``[B, T]`` per-token values over the ``keep`` positions, by ``loss_type``."""
    masked = torch.where(keep, values, torch.zeros_like(values))
    per_row = keep.sum(dim=1)
    if options.loss_type == "bnpo":
        return masked.sum() / per_row.sum().clamp(min=1)
    if options.loss_type == "grpo":
        rows = per_row > 0
        row_means = masked.sum(dim=1) / per_row.clamp(min=1)
        return row_means[rows].sum() / rows.sum().clamp(min=1)
    if options.loss_type == "dr_grpo":
        rows = (per_row > 0).sum().clamp(min=1)
        return masked.sum() / (rows * options.max_completion_length)
    return masked.sum() / options.global_tokens  # dapo


def _kl_term(logprobs: torch.Tensor, behaviour: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor,
             options: LossOptions) -> torch.Tensor:
    """The KL(π‖ref) estimate of docs/architecture.md §7, aggregated like the objective."""
    zeros = torch.zeros_like(logprobs)
    delta = torch.where(keep, ref - logprobs, zeros)  # log(ref / π)
    k3 = torch.exp(delta) - delta - 1.0
    if options.kl_estimator == "k3":
        return _aggregate(k3, keep, options)
    # k3_is: each token's k3 times its prefix's weight π(y≤t)/μ(y≤t), capped in value, with the
    # gradient of log π(y≤t): every token answers for the KL of the tokens after it.
    log_w = torch.where(keep, logprobs - behaviour, zeros).cumsum(dim=1)
    capped = log_w.detach() if options.is_cap is None else log_w.detach().clamp(max=math.log(options.is_cap))
    weight = torch.where(keep, torch.exp(capped), zeros) * torch.exp(log_w - log_w.detach())
    return _aggregate(weight * k3, keep, options)


def _step_stats(ratio: torch.Tensor, clipped: torch.Tensor, gap: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        count = keep.sum().clamp(min=1).to(ratio.dtype)
        abs_gap = torch.where(keep, gap.abs(), torch.zeros_like(gap))
        return {
            "clip_frac": float((clipped & keep).sum() / count),
            "ratio_mean": float(torch.where(keep, ratio.detach(), torch.zeros_like(ratio)).sum() / count),
            "offpolicy_gap_mean": float(abs_gap.sum() / count),
            "offpolicy_gap_max": float(abs_gap.max()) if keep.any() else 0.0,
        }


def _weight_stats(weights: ImportanceWeights | None, keep: torch.Tensor, options: LossOptions) -> dict[str, float]:
    if weights is None:
        return {"is_weight_mean": 1.0, "is_truncated_frac": 0.0, "is_masked_frac": 0.0, "is_ess": 1.0}
    with torch.no_grad():
        n = keep.sum().clamp(min=1)
        applies = keep & ~weights.over if options.is_mode == "mask" else keep
        over = float(weights.over.sum() / n)
        # (Σw)² / (n Σw²) from the log weights: finite even where a weight overflows.
        log_w = torch.where(keep, weights.log_raw, torch.full_like(weights.log_raw, -math.inf))
        log_ess = (2 * torch.logsumexp(log_w.flatten(), 0) - torch.logsumexp(2 * log_w.flatten(), 0)
                   - n.to(log_w.dtype).log())
        return {
            "is_weight_mean": float(weights.applied.sum() / applies.sum().clamp(min=1)),
            "is_truncated_frac": over if options.is_mode == "truncate" else 0.0,
            "is_masked_frac": over if options.is_mode == "mask" else 0.0,
            "is_ess": float(log_ess.exp()) if keep.any() else 1.0,
        }

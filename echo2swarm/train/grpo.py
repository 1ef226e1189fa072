"""GRPO maths: group advantages, per-token logprobs, and the clipped (decoupled) policy loss.

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
from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = ["CompletionLogits", "LossOptions", "completion_logits", "group_advantages", "grpo_loss", "token_logprobs"]


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


LossType = Literal["bnpo", "grpo", "dr_grpo", "dapo"]
IsMode = Literal["truncate", "mask"]
IsLevel = Literal["token", "sequence", "sequence_product"]
KlEstimator = Literal["k3_is", "k3"]


@dataclass(frozen=True)
class LossOptions:
    """How :func:`grpo_loss` turns per-token terms into one loss (docs: ``TrainConfig``).

    - ``loss_type`` (TRL's names): ``bnpo`` token mean over the minibatch; ``grpo`` mean over
      sequences of each sequence's token mean; ``dr_grpo`` token sum over ``sequences ×
      max_completion_length`` (Dr. GRPO's constant normaliser, no length bias); ``dapo`` token sum
      over ``global_tokens``, the completion tokens of the whole step (every minibatch of it).
    - ``is_mode``: above ``is_cap`` the importance weight is ``truncate``-d to the cap, or the token
      (``is_level="sequence"``: the sequence) is ``mask``-ed out of the objective (AReaL-style).
    - ``is_level``: ``token`` weights, or one ``sequence`` weight: the geometric mean of its tokens'
      weights (length-normalised, so long sequences are not crushed or exploded), or
      ``sequence_product``: the product of its tokens' weights, π(y)/μ(y) of the whole completion,
      the classical truncated importance weight: it also corrects for the behaviour policy's prefixes
      (a token weight only corrects the last token's choice, given a prefix μ chose), so the update
      is unbiased below the cap; its variance grows with length, so use it for short completions.
    - ``kl_estimator``: ``k3_is`` is ``(π/μ) k3`` with the gradient flowing through ``π/μ``: an
      unbiased estimate of KL(π‖ref), value and gradient, on tokens sampled from the behaviour policy
      μ; ``k3`` is the plain k3 on those tokens, whose gradient is that of KL(ref‖π) (kept to
      reproduce older runs).
    """

    loss_type: LossType = "bnpo"
    is_mode: IsMode = "truncate"
    is_level: IsLevel = "token"
    kl_estimator: KlEstimator = "k3_is"
    max_completion_length: int | None = None  # dr_grpo's constant
    global_tokens: float | None = None  # dapo's normaliser

    def __post_init__(self) -> None:
        for name, allowed in (("loss_type", LossType), ("is_mode", IsMode), ("is_level", IsLevel),
                              ("kl_estimator", KlEstimator)):
            if getattr(self, name) not in get_args(allowed):
                raise ValueError(f"{name} must be one of {get_args(allowed)}, got {getattr(self, name)!r}")
        if self.loss_type == "dr_grpo" and not (self.max_completion_length and self.max_completion_length > 0):
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length > 0 (train.max_new_tokens)")
        if self.loss_type == "dapo" and not (self.global_tokens and self.global_tokens > 0):
            raise ValueError("loss_type 'dapo' needs global_tokens > 0 (the step's completion tokens)")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum() / count


def _aggregate(token_loss: torch.Tensor, keep: torch.Tensor, options: LossOptions) -> torch.Tensor:
    """One scalar from ``[B, T]`` per-token losses over the ``keep`` positions, by ``options.loss_type``."""
    masked = torch.where(keep, token_loss, torch.zeros_like(token_loss))
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


def log_importance_weights(gap: torch.Tensor, keep: torch.Tensor, level: IsLevel) -> torch.Tensor:
    """``[B, T]`` per-token log(proximal / behaviour) -> the log importance weight of each token at
    ``level`` (see :class:`LossOptions`): the token's own, its sequence's mean, or its sequence's sum."""
    if level == "token":
        return gap
    if level == "sequence":
        return _sequence_mean(gap, keep).expand_as(gap)
    return torch.where(keep, gap, torch.zeros_like(gap)).sum(dim=1, keepdim=True).expand_as(gap)


def _sequence_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` -> ``[B, 1]``: the mean over each row's kept positions (0 for an empty row)."""
    count = keep.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(keep, values, torch.zeros_like(values)).sum(dim=1, keepdim=True) / count


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    proximal_logprobs: torch.Tensor | None = None,
    is_cap: float | None = 2.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    options: LossOptions | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO policy loss (to minimise) and float stats.

    - ``logprobs`` ``[B, T]``: current policy, with grad. ``behaviour_logprobs`` ``[B, T]``: the
      rollout peer's, from the version that generated the tokens (the distribution it sampled
      from). ``advantages`` ``[B]`` (one per sequence, broadcast over tokens) or ``[B, T]``.
      ``mask`` ``[B, T]``: 1 on completion tokens.
    - Without ``proximal_logprobs``: PPO-clip against the behaviour policy,
      ``r = exp(lp - behaviour)``, token loss ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``.
    - With ``proximal_logprobs`` (decoupled PPO for stale rollouts; the learner's policy before
      this step's first update): ``r = exp(lp - proximal)`` clipped as above, each token weighted by
      the behaviour importance weight ``w = exp(proximal - behaviour)`` (per token, or per sequence:
      see :class:`LossOptions`), truncated at ``is_cap`` or masked above it (``is_cap=None``: neither).
      No gradient flows through ``w`` or ``proximal``.
    - With ``ref_logprobs``: a KL(π‖ref) estimate (``options.kl_estimator``) is reported as ``kl``
      and, when ``kl_coef > 0``, added as ``kl_coef * kl``.
    - Aggregation over tokens: ``options.loss_type`` (default: token mean).

    Masked positions never matter, whatever they hold (inf and NaN included). Stats: ``loss``,
    ``clip_frac`` (kept tokens where the clipped branch is the active, strictly smaller objective),
    ``ratio_mean`` (of ``r``), ``kl`` (0.0 without a reference), ``is_weight_mean`` (of the weights
    applied; 1.0 without proximal logprobs), and the off-policy gap between the proximal and the
    behaviour policy: ``offpolicy_gap_mean`` / ``offpolicy_gap_max`` (mean and max of
    ``|proximal - behaviour|`` per token), ``is_truncated_frac`` / ``is_masked_frac`` (tokens whose
    weight was cut or that left the objective), ``is_ess`` (effective sample size of the raw weights
    over the tokens, ``(Σw)² / (n Σw²)``, 1.0 when every weight is equal).
    """
    options = options or LossOptions()
    shape = logprobs.shape
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got {tuple(shape)}")
    for name, tensor in (
        ("behaviour_logprobs", behaviour_logprobs),
        ("mask", mask),
        ("proximal_logprobs", proximal_logprobs),
        ("ref_logprobs", ref_logprobs),
    ):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} like logprobs")
    if advantages.ndim == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages has {advantages.shape[0]} entries for a batch of {shape[0]}")
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != shape:
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if is_cap is not None and is_cap <= 0:
        raise ValueError(f"is_cap must be > 0 or None, got {is_cap}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")

    keep = mask.bool()
    zeros = torch.zeros_like(logprobs)
    advantages = advantages.detach().to(logprobs.dtype)
    behaviour = behaviour_logprobs.detach()

    # Zero the log-ratio on masked positions *before* exp, so padding garbage can produce
    # neither inf nor NaN, forward or backward.
    base = (behaviour if proximal_logprobs is None else proximal_logprobs).detach()
    ratio = torch.exp(torch.where(keep, logprobs - base, zeros))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = -torch.minimum(unclipped, clipped)

    gap = torch.where(keep, base - behaviour, zeros)  # log(proximal / behaviour); 0 without proximal
    stats_w = {"is_weight_mean": 1.0, "is_truncated_frac": 0.0, "is_masked_frac": 0.0, "is_ess": 1.0}
    objective = keep  # the positions the loss is taken over
    if proximal_logprobs is not None:
        log_w = log_importance_weights(gap, keep, options.is_level)
        raw = torch.exp(log_w)
        weight = raw
        over = keep & (raw > is_cap) if is_cap is not None else torch.zeros_like(keep)
        if is_cap is not None and options.is_mode == "truncate":
            weight = raw.clamp(max=is_cap)
        elif is_cap is not None:
            objective = keep & ~over
        token_loss = token_loss * weight
        n = keep.sum().clamp(min=1).to(logprobs.dtype)
        kept_raw = torch.where(keep, raw, zeros)
        stats_w = {
            "is_weight_mean": float(_masked_mean(weight, objective, objective.sum().clamp(min=1))),
            "is_truncated_frac": float(over.sum() / n) if options.is_mode == "truncate" else 0.0,
            "is_masked_frac": float(over.sum() / n) if options.is_mode == "mask" else 0.0,
            "is_ess": float(kept_raw.sum() ** 2 / (n * (kept_raw ** 2).sum()).clamp(min=1e-30)),
        }

    loss = _aggregate(token_loss, objective, options)

    kl_value = 0.0
    if ref_logprobs is not None:
        delta = torch.where(keep, ref_logprobs.detach() - logprobs, zeros)  # log(ref / π)
        k3 = torch.exp(delta) - delta - 1.0
        if options.kl_estimator == "k3_is":
            # (π/μ) k3, the weight's value truncated like the objective's but its gradient kept:
            # d/dθ [(π/μ) k3] = (π/μ)(log π - log ref) d log π, whose expectation under μ is ∇KL(π‖ref).
            log_iw = torch.where(keep, logprobs.detach() - behaviour, zeros)
            iw_value = torch.exp(log_iw) if is_cap is None else torch.exp(log_iw).clamp(max=is_cap)
            iw = iw_value * torch.exp(torch.where(keep, logprobs - logprobs.detach(), zeros))
            k3 = iw * k3
        kl = _aggregate(k3, keep, options)
        kl_value = float(kl.detach())
        if kl_coef > 0:
            loss = loss + kl_coef * kl

    with torch.no_grad():
        count = keep.sum().clamp(min=1).to(logprobs.dtype)
        clip_frac = float(_masked_mean((clipped < unclipped).to(logprobs.dtype), keep, count))
        ratio_mean = float(_masked_mean(ratio, keep, count))
        abs_gap = gap.abs()
        gap_mean = float(_masked_mean(abs_gap, keep, count))
        gap_max = float(torch.where(keep, abs_gap, zeros).max()) if keep.any() else 0.0
    stats = {
        "loss": float(loss.detach()),
        "clip_frac": clip_frac,
        "ratio_mean": ratio_mean,
        "kl": kl_value,
        **stats_w,
        "offpolicy_gap_mean": gap_mean,
        "offpolicy_gap_max": gap_max,
    }
    return loss, stats

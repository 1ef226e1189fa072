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

import torch

__all__ = ["CompletionLogits", "completion_logits", "group_advantages", "grpo_loss", "token_logprobs"]


def group_advantages(rewards: torch.Tensor, *, scale_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of one group: ``r_i - mean(r)``, divided by ``std(r) + eps`` when ``scale_std``.

    ``rewards`` is ``[G]`` (or ``[..., G]``: each row along the last dim is one group). The std is
    the population std (``unbiased=False``). A group whose rewards are all equal carries no
    learning signal and gets exact zeros, not ``rounding error / eps``.
    """
    rewards = torch.as_tensor(rewards)
    if rewards.ndim == 0:
        raise ValueError("rewards must have at least one dimension (the group)")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if scale_std:
        centred = centred / (rewards.std(dim=-1, unbiased=False, keepdim=True) + eps)
    flat = (rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True))
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


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum() / count


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO policy loss (to minimise), token-mean over the batch, and float stats.

    - ``logprobs`` ``[B, T]``: current policy, with grad. ``behaviour_logprobs`` ``[B, T]``: the
      rollout peer's, from the version that generated the tokens. ``advantages`` ``[B]`` (one per
      sequence, broadcast over tokens) or ``[B, T]``. ``mask`` ``[B, T]``: 1 on completion tokens.
    - Without ``proximal_logprobs``: PPO-clip against the behaviour policy,
      ``r = exp(lp - behaviour)``, token loss ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``.
    - With ``proximal_logprobs`` (decoupled PPO for stale rollouts; the learner's own policy at
      the start of this step): ``r = exp(lp - proximal)`` clipped as above, each token weighted by
      ``w = min(exp(proximal - behaviour), is_cap)`` (``is_cap=None``: no truncation). No
      gradient flows through ``w`` or ``proximal``.
    - With ``ref_logprobs``: the k3 estimate ``exp(ref - lp) - (ref - lp) - 1`` (token mean) is
      reported as ``kl`` and, when ``kl_coef > 0``, added as ``kl_coef * kl``.

    Masked positions never matter, whatever they hold (inf and NaN included). Stats: ``loss``,
    ``clip_frac`` (masked tokens where the clipped branch is the active, strictly smaller
    objective), ``ratio_mean`` (of the clipped ratio ``r``), ``kl`` (0.0 without a reference),
    ``is_weight_mean`` (1.0 without proximal logprobs).
    """
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
    count = keep.sum().clamp(min=1).to(logprobs.dtype)
    zeros = torch.zeros_like(logprobs)
    advantages = advantages.detach().to(logprobs.dtype)

    # Zero the log-ratio on masked positions *before* exp, so padding garbage can produce
    # neither inf nor NaN, forward or backward.
    base = (behaviour_logprobs if proximal_logprobs is None else proximal_logprobs).detach()
    ratio = torch.exp(torch.where(keep, logprobs - base, zeros))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = -torch.minimum(unclipped, clipped)

    if proximal_logprobs is not None:
        log_w = torch.where(keep, proximal_logprobs.detach() - behaviour_logprobs.detach(), zeros)
        weight = torch.exp(log_w)
        if is_cap is not None:
            weight = weight.clamp(max=is_cap)
        token_loss = token_loss * weight
        is_weight_mean = float(_masked_mean(weight, keep, count))
    else:
        is_weight_mean = 1.0

    loss = _masked_mean(token_loss, keep, count)

    kl_value = 0.0
    if ref_logprobs is not None:
        delta = torch.where(keep, ref_logprobs.detach() - logprobs, zeros)
        kl = _masked_mean(torch.exp(delta) - delta - 1.0, keep, count)
        kl_value = float(kl.detach())
        if kl_coef > 0:
            loss = loss + kl_coef * kl

    with torch.no_grad():
        clip_frac = float(_masked_mean((clipped < unclipped).to(logprobs.dtype), keep, count))
        ratio_mean = float(_masked_mean(ratio, keep, count))
    stats = {
        "loss": float(loss.detach()),
        "clip_frac": clip_frac,
        "ratio_mean": ratio_mean,
        "kl": kl_value,
        "is_weight_mean": is_weight_mean,
    }
    return loss, stats

"""Short supervised warm-up and greedy evaluation, so RL starts from a model that sometimes answers right.

    task.prompt(i) + task.answer(i) ─► [prompt ids | answer ids, eos] ─► masked next-token loss ─► AdamW
    task.prompt(i, "eval") ─► batched greedy decoding (left padding) ─► task.reward(...) ─► accuracy

GRPO learns nothing while every completion scores 0 (two-digit addition from a random init is such
a case), so the demo and tests fine-tune the tiny model on reference answers for a few hundred
steps first. Only the answer and EOS tokens carry loss. The thread count is the caller's business.

How many steps that takes is not a constant: the tiny model sits near 10 % for hundreds of steps
and then learns to carry within ~100, at a step that moves with the seed and with the CPU's
floating-point kernels (seed 0 got there before step 700 on the CPUs this project first ran on,
at step ~1050 on a Sapphire Rapids Xeon, whose torch kernels differ). So the warm-up can
stop on a target instead (`until_accuracy`): every `check_every` steps it scores greedy answers
on train prompts, and it stops at the first check at or above the target.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from echo2swarm.models.kv_cache import kv_cache
from echo2swarm.runtime.logging import get_logger
from echo2swarm.tasks.base import SupervisedTask, Task

__all__ = ["WarmupResult", "greedy_accuracy", "greedy_complete", "supervised_warmup"]

logger = get_logger(__name__)

_IGNORE = -100
CHECK_PROMPTS = 128  # train prompts a target check scores: ±0.04 standard error at 30 %


@dataclass(frozen=True)
class WarmupResult:
    """What a warm-up did: the steps it ran, the last step's loss, and the greedy accuracy on
    train prompts at its last check (None when it ran without a target)."""

    steps: int
    loss: float
    accuracy: float | None = None


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token")
    return int(pad)


def _eos_id(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; completions could never finish")
    return int(tokenizer.eos_token_id)


def _encode_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    # Default special-token handling: the same encoding a rollout engine gives a prompt string.
    ids: list[list[int]] = tokenizer(list(texts))["input_ids"]
    for text, row in zip(texts, ids):
        if not row:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
    return ids


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip padding (left or right): real tokens count 0, 1, 2, ...; pads get 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@contextlib.contextmanager
def _seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed dropout (if the model has any) on ``device`` only; the caller's RNG states come back after."""
    if device.type != "cuda":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.random.fork_rng(devices=[index]), torch.cuda.device(index):
        torch.default_generator.manual_seed(seed)
        torch.cuda.manual_seed(seed)
        yield


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer: Any,
    task: SupervisedTask,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
    until_accuracy: float | None = None,
    check_every: int = 50,
) -> WarmupResult:
    """Fine-tune ``model`` in place on ``task``'s train answers for at most ``steps`` steps.

    Each step takes ``batch_size`` consecutive train prompts, starting at an offset drawn from
    ``seed``; the sequence is prompt ids + answer ids + EOS with loss on the answer and EOS only
    (token mean over the batch), AdamW (betas 0.9/0.98, weight decay 0.01) at a constant ``lr``.
    ``progress(step, loss)`` is called after every step (1-based). With ``until_accuracy``, every
    ``check_every`` steps (and after the last) the greedy accuracy on the first `CHECK_PROMPTS`
    train prompts is measured, and the warm-up stops at the first check that reaches it; one that
    never does logs a warning. The eval split is never looked at. The model's train/eval mode is
    restored afterwards.

    Example::

        model, tokenizer = build_tiny_model(seed=0)
        supervised_warmup(model, tokenizer, ArithTask(seed=0), steps=3000, until_accuracy=0.3)
        greedy_accuracy(model, tokenizer, ArithTask(seed=0))   # ~0.3 on held-out prompts
    """
    if steps < 1 or batch_size < 1 or check_every < 1:
        raise ValueError(f"steps, batch_size and check_every must be >= 1, got steps={steps}, "
                         f"batch_size={batch_size}, check_every={check_every}")
    if until_accuracy is not None and not 0.0 < until_accuracy <= 1.0:
        raise ValueError(f"until_accuracy must be in (0, 1], got {until_accuracy}")
    if not callable(getattr(task, "answer", None)):
        raise TypeError(f"{type(task).__name__} has no answer(index, split) method, so it cannot be used for warm-up")
    device = _device(model)
    eos, pad = _eos_id(tokenizer), _pad_id(tokenizer)
    start = random.Random(f"warmup:{seed}").randrange(1 << 30)
    # beta2 0.98 rather than 0.999 and no gradient clipping: on the tiny model's two-digit addition
    # both reached the "carry" phase sooner (3 seeds, 700 steps: greedy 0.58 vs 0.46 with 0.999,
    # and clipping at 1.0 delayed it by hundreds of steps).
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98))
    was_training = model.training
    model.train()
    loss_value, accuracy, done = float("nan"), None, 0
    began = time.perf_counter()
    try:
        with _seeded_rng(seed, device):
            for step in range(steps):
                first = start + step * batch_size
                indices = range(first, first + batch_size)
                prompts = _encode_prompts(tokenizer, [task.prompt(i).text for i in indices])
                answers = tokenizer([task.answer(i) for i in indices], add_special_tokens=False)["input_ids"]
                input_ids, attention_mask, labels = _training_batch(prompts, answers, eos, pad)
                input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
                logits = model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask)
                ).logits
                loss = F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=_IGNORE
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_value, done = loss.item(), step + 1
                if progress is not None:
                    progress(done, loss_value)
                if until_accuracy is not None and (done % check_every == 0 or done == steps):
                    accuracy = greedy_accuracy(model, tokenizer, task, n=CHECK_PROMPTS, split="train")
                    if accuracy >= until_accuracy:
                        break
    finally:
        model.train(was_training)
    logger.info(
        "warm-up: %d steps x %d sequences in %.1f s, final loss %.4f%s",
        done, batch_size, time.perf_counter() - began, loss_value,
        "" if accuracy is None else f", greedy accuracy {accuracy:.3f} on {CHECK_PROMPTS} train prompts",
    )
    if until_accuracy is not None and accuracy is not None and accuracy < until_accuracy:
        logger.warning(
            "warm-up: greedy accuracy %.3f after %d steps, short of the target %.2f; RL may learn slowly "
            "from here (allow more warm-up steps)", accuracy, done, until_accuracy,
        )
    return WarmupResult(steps=done, loss=loss_value, accuracy=accuracy)


def _training_batch(
    prompts: list[list[int]], answers: list[list[int]], eos: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``[prompt | answer, eos]`` rows; labels are ``-100`` except on answer and eos."""
    rows = [p + a + [eos] for p, a in zip(prompts, answers)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), _IGNORE, dtype=torch.long)
    for i, (p, row) in enumerate(zip(prompts, rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        labels[i, len(p) : len(row)] = torch.tensor(row[len(p) :])
    return input_ids, attention_mask, labels


def greedy_complete(
    model: torch.nn.Module, tokenizer: Any, texts: Sequence[str], max_new_tokens: int = 8
) -> list[tuple[str, bool]]:
    """Greedy completions of ``texts`` as one left-padded batch: ``(text without specials, ended with EOS)``.

    Runs under ``torch.inference_mode()`` in eval mode; the model's mode is restored afterwards.
    """
    if not texts:
        return []
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = _device(model)
    eos, pad = _eos_id(tokenizer), _pad_id(tokenizer)
    prompts = _encode_prompts(tokenizer, texts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    was_training = model.training
    model.eval()
    generated: list[list[int]] = [[] for _ in prompts]
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    cache = DynamicCache(config=model.config)
    try:
        with torch.inference_mode():
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=_positions(attention_mask),
                use_cache=True,
                logits_to_keep=1,
                **kv_cache(model, cache),
            )
            for step in range(max_new_tokens):
                next_ids = out.logits[:, -1].argmax(-1)
                for tokens, token, done in zip(generated, next_ids.tolist(), finished.tolist()):
                    if not done:
                        tokens.append(token)
                finished |= next_ids == eos
                if bool(finished.all()) or step == max_new_tokens - 1:
                    break
                # Rows that already finished keep decoding pad; their output is ignored.
                next_ids = torch.where(finished, torch.full_like(next_ids, pad), next_ids)
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(prompts), 1))], dim=-1)
                out = model(
                    input_ids=next_ids[:, None],
                    attention_mask=attention_mask,
                    position_ids=attention_mask.sum(-1, keepdim=True) - 1,
                    use_cache=True,
                    **kv_cache(model, cache),
                )
    finally:
        model.train(was_training)

    results = []
    for tokens in generated:
        ended = bool(tokens) and tokens[-1] == eos
        text = tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=True)
        results.append((text, ended))
    return results


def greedy_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    n: int | None = None,
    max_new_tokens: int = 8,
    batch_size: int = 64,
    split: str = "eval",
) -> float:
    """Mean ``task.reward`` of greedy completions over the first ``n`` prompts of ``split``.

    ``n=None`` means the whole eval split; the train split is unbounded, so it needs an ``n``.
    """
    if split == "eval":
        total = task.eval_size() if n is None else min(n, task.eval_size())
    elif n is None:
        raise ValueError(f"the {split} split has no end: say how many prompts to score (n)")
    else:
        total = n
    if total < 1:
        raise ValueError(f"no {split} prompts to score (eval_size={task.eval_size()}, n={n})")
    prompts = [task.prompt(i, split) for i in range(total)]
    score = 0.0
    for first in range(0, total, batch_size):
        chunk = prompts[first : first + batch_size]
        completions = greedy_complete(model, tokenizer, [p.text for p in chunk], max_new_tokens)
        score += sum(task.reward(p.prompt_id, text, ended) for p, (text, ended) in zip(chunk, completions))
    return score / total

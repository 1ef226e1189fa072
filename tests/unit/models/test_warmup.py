"""Supervised warm-up lowers the loss; batched greedy decoding matches one-by-one decoding."""

from __future__ import annotations

import pytest
import torch

from echo2swarm.models.tiny import build_tiny_model
from echo2swarm.models.warmup import greedy_accuracy, greedy_complete, supervised_warmup
from echo2swarm.tasks import ArithTask, Prompt


@pytest.fixture(scope="module")
def warmed() -> tuple[torch.nn.Module, object, ArithTask, list[float]]:
    model, tokenizer = build_tiny_model(seed=0)
    task = ArithTask(seed=0)
    losses: list[float] = []
    final = supervised_warmup(
        model, tokenizer, task, steps=150, batch_size=32, seed=0, progress=lambda step, loss: losses.append(loss)
    )
    assert final == losses[-1]
    return model, tokenizer, task, losses


def test_warmup_lowers_the_loss(warmed: tuple) -> None:
    model, _, _, losses = warmed
    assert len(losses) == 150
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert first > 2.5  # ~ln(49) for a random init
    assert last < 0.6 * first, (first, last)  # measured: ~3.0 -> ~1.3
    assert not model.training  # build_tiny_model returns an eval-mode model; warm-up restores it


def test_warmup_is_seeded_and_leaves_the_callers_rng_alone() -> None:
    def run(seed: int) -> float:
        model, tokenizer = build_tiny_model(seed=1)
        return supervised_warmup(model, tokenizer, ArithTask(seed=0), steps=3, batch_size=8, seed=seed)

    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    a = run(0)
    assert torch.equal(torch.rand(1), expected_draw)
    assert run(0) == a
    assert run(1) != a


def test_warmup_rejects_tasks_without_answers_and_bad_steps() -> None:
    model, tokenizer = build_tiny_model(seed=0)

    class NoAnswers:
        name = "x"

        def prompt(self, index: int, split: str = "train") -> Prompt:
            return Prompt(f"{split}:{index}", "1+1=")

    with pytest.raises(TypeError, match="answer"):
        supervised_warmup(model, tokenizer, NoAnswers(), steps=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        supervised_warmup(model, tokenizer, ArithTask(), steps=0)


def _reference_greedy(model: torch.nn.Module, tokenizer, text: str, max_new_tokens: int) -> tuple[str, bool]:
    """Unpadded, cache-free greedy decoding of one prompt: the ground truth for the batched path."""
    ids = tokenizer(text)["input_ids"]
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                return tokenizer.decode(out, skip_special_tokens=True), True
            out.append(token)
    return tokenizer.decode(out, skip_special_tokens=True), False


def test_batched_greedy_equals_one_by_one(warmed: tuple) -> None:
    model, tokenizer, task, _ = warmed
    # Mixed prompt lengths (4 to 10 characters) so left padding varies across rows.
    texts = ["1+2=", "99+99=", "5+37=", "40+4=", "7+7=", "123+456=", "0+0=", "12+34+56=", task.prompt(0, "eval").text]
    batched = greedy_complete(model, tokenizer, texts, max_new_tokens=6)
    single = [greedy_complete(model, tokenizer, [t], max_new_tokens=6)[0] for t in texts]
    reference = [_reference_greedy(model, tokenizer, t, 6) for t in texts]
    assert batched == single == reference
    assert any(finished for _, finished in batched)
    assert all(tokenizer.eos_token not in text for text, _ in batched)


def test_greedy_accuracy_is_a_fraction_and_independent_of_batch_size(warmed: tuple) -> None:
    model, tokenizer, task, _ = warmed
    model.train()
    try:
        big = greedy_accuracy(model, tokenizer, task, n=24, batch_size=64)
        small = greedy_accuracy(model, tokenizer, task, n=24, batch_size=5)
        assert model.training  # mode restored
    finally:
        model.eval()
    assert 0.0 <= big <= 1.0
    assert big == small
    assert 0.0 <= greedy_accuracy(model, tokenizer, task, n=None, max_new_tokens=4) <= 1.0


def test_greedy_accuracy_scores_with_the_tasks_reward() -> None:
    model, tokenizer = build_tiny_model(seed=0)
    seen: list[tuple[str, str, bool]] = []

    class Recorder(ArithTask):
        def reward(self, prompt_id: str, completion: str, finished: bool) -> float:
            seen.append((prompt_id, completion, finished))
            return 1.0 if prompt_id == "eval:0" else 0.0

    assert greedy_accuracy(model, tokenizer, Recorder(), n=4, max_new_tokens=3) == 0.25
    assert [pid for pid, _, _ in seen] == ["eval:0", "eval:1", "eval:2", "eval:3"]
    assert all(finished or len(text) == 3 for _, text, finished in seen)

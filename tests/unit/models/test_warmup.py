"""Supervised warm-up lowers the loss; batched greedy decoding matches one-by-one decoding."""

from __future__ import annotations

import pytest
import torch

from echo2swarm.models.tiny import build_tiny_model
from echo2swarm.models.warmup import CHECK_PROMPTS, greedy_accuracy, greedy_complete, supervised_warmup
from echo2swarm.tasks import ArithTask, Prompt


@pytest.fixture(scope="module")
def warmed() -> tuple[torch.nn.Module, object, ArithTask, list[float]]:
    model, tokenizer = build_tiny_model(seed=0)
    task = ArithTask(seed=0)
    losses: list[float] = []
    result = supervised_warmup(
        model, tokenizer, task, steps=150, batch_size=32, seed=0, progress=lambda step, loss: losses.append(loss)
    )
    assert (result.steps, result.loss, result.accuracy) == (150, losses[-1], None)
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
        return supervised_warmup(model, tokenizer, ArithTask(seed=0), steps=3, batch_size=8, seed=seed).loss

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
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="until_accuracy"):
            supervised_warmup(model, tokenizer, ArithTask(), steps=1, until_accuracy=bad)
    with pytest.raises(ValueError, match="check_every"):
        supervised_warmup(model, tokenizer, ArithTask(), steps=1, until_accuracy=0.5, check_every=0)


class _Scripted(ArithTask):
    """Arith whose train-prompt reward follows a script, one score per check (the eval split is never used)."""

    def __init__(self, scores: list[float]):
        super().__init__(seed=0)
        self.scores, self.checks, self.scored = scores, 0, 0

    def reward(self, prompt_id: str, completion: str, finished: bool) -> float:
        assert prompt_id.startswith("train:"), prompt_id
        score = self.scores[min(self.checks, len(self.scores) - 1)]
        self.scored += 1
        if self.scored == CHECK_PROMPTS:
            self.checks, self.scored = self.checks + 1, 0
        return score


def test_a_target_stops_the_warmup_at_the_first_check_that_reaches_it() -> None:
    model, tokenizer = build_tiny_model(seed=0)
    task = _Scripted([0.1, 0.25, 0.5, 0.9])
    steps: list[int] = []
    result = supervised_warmup(model, tokenizer, task, steps=100, batch_size=4, until_accuracy=0.5, check_every=5,
                               progress=lambda step, loss: steps.append(step))
    assert (result.steps, result.accuracy) == (15, 0.5)  # checks after steps 5, 10, 15
    assert steps == list(range(1, 16)) and task.checks == 3


def test_a_target_never_reached_runs_every_step_checks_the_last_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    model, tokenizer = build_tiny_model(seed=0)
    task = _Scripted([0.0])
    result = supervised_warmup(model, tokenizer, task, steps=12, batch_size=4, until_accuracy=0.3, check_every=5)
    assert (result.steps, result.accuracy) == (12, 0.0)
    assert task.checks == 3  # after steps 5, 10 and the last one, 12
    assert "short of the target 0.30" in caplog.text


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
    assert 0.0 <= greedy_accuracy(model, tokenizer, task, n=8, split="train") <= 1.0
    with pytest.raises(ValueError, match="no end"):
        greedy_accuracy(model, tokenizer, task, split="train")


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

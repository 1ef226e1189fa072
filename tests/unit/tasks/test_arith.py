"""ArithTask: deterministic prompts, a fixed held-out eval split, exact-match-then-EOS reward."""

from __future__ import annotations

import pytest

from echo2swarm.tasks import ArithTask, Prompt, SupervisedTask, Task


def test_is_a_supervised_task() -> None:
    task = ArithTask()
    assert isinstance(task, Task) and isinstance(task, SupervisedTask)
    assert task.name == "arith"


def test_prompts_are_deterministic_across_instances() -> None:
    a, b = ArithTask(seed=3), ArithTask(seed=3)
    for split, n in (("train", 50), ("eval", 200)):
        assert [a.prompt(i, split) for i in range(n)] == [b.prompt(i, split) for i in range(n)]
        assert [a.answer(i, split) for i in range(n)] == [b.answer(i, split) for i in range(n)]
    # Random access gives the same prompt as sequential access.
    assert a.prompt(12345) == ArithTask(seed=3).prompt(12345)
    assert [ArithTask(seed=4).prompt(i).text for i in range(20)] != [a.prompt(i).text for i in range(20)]


def test_prompt_format_and_answer() -> None:
    task = ArithTask(seed=0, max_operand=99)
    for i in range(200):
        p = task.prompt(i)
        assert p == Prompt(prompt_id=f"train:{i}", text=p.text)
        left, right = p.text.removesuffix("=").split("+")
        assert p.text.endswith("=") and " " not in p.text
        assert 0 <= int(left) <= 99 and 0 <= int(right) <= 99
        assert task.answer(i) == str(int(left) + int(right))


def test_eval_split_is_fixed_size_and_disjoint_from_train() -> None:
    task = ArithTask(seed=0)
    assert task.eval_size() == 200
    eval_texts = [task.prompt(i, "eval").text for i in range(200)]
    assert len(set(eval_texts)) == 200
    train_texts = {task.prompt(i).text for i in range(5000)}
    assert train_texts.isdisjoint(eval_texts)
    with pytest.raises(ValueError, match="out of range"):
        task.prompt(200, "eval")


def test_small_operand_space_still_gives_200_eval_prompts() -> None:
    task = ArithTask(seed=0, max_operand=9)  # 100 pairs: eval repeats and overlaps train (documented)
    assert task.eval_size() == 200
    assert all(task.prompt(i, "eval").prompt_id == f"eval:{i}" for i in range(200))


def test_reward_is_exact_match_then_eos() -> None:
    task = ArithTask(seed=0)
    pid, answer = task.prompt(7).prompt_id, task.answer(7)
    assert task.reward(pid, answer, finished=True) == 1.0
    assert task.reward(pid, answer, finished=False) == 0.0  # right digits but cut by max tokens
    assert task.reward(pid, answer + "0", finished=True) == 0.0
    assert task.reward(pid, answer + "=", finished=True) == 0.0
    assert task.reward(pid, "x" + answer, finished=True) == 0.0
    assert task.reward(pid, "", finished=True) == 0.0
    assert task.reward(pid, str(int(answer) + 1), finished=True) == 0.0
    # Surrounding whitespace is stripped; inner whitespace is not.
    assert task.reward(pid, f" {answer} ", finished=True) == 1.0
    if len(answer) > 1:
        assert task.reward(pid, f"{answer[0]} {answer[1:]}", finished=True) == 0.0
    eval_pid = task.prompt(3, "eval").prompt_id
    assert task.reward(eval_pid, task.answer(3, "eval"), finished=True) == 1.0


@pytest.mark.parametrize(
    "prompt_id",
    ["", "train", "train:", "train:-1", "train:01", "train:1.0", "test:3", "eval:200", "eval:x", " train:1", "train:1:2", "1+2="],
)
def test_malformed_prompt_ids_raise(prompt_id: str) -> None:
    with pytest.raises(ValueError):
        ArithTask().reward(prompt_id, "3", finished=True)


def test_bad_indices_and_options_raise() -> None:
    task = ArithTask()
    for index, split in ((-1, "train"), (1.5, "train"), (0, "test")):
        with pytest.raises(ValueError):
            task.prompt(index, split)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ArithTask(max_operand=0)


def test_prompt_id_carries_no_answer() -> None:
    task = ArithTask(seed=0)
    for split, n in (("train", 300), ("eval", 200)):
        for i in range(n):
            p = task.prompt(i, split)
            assert p.prompt_id == f"{split}:{i}"
            assert p.text not in p.prompt_id

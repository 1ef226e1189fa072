"""MathTask: loading and validation, boxed extraction, math_verify grading that never raises."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from echo2swarm.tasks import MathTask, SupervisedTask, Task
from echo2swarm.tasks.math import grade_answer, last_boxed, load_problems, sample_path


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_sample_file_loads_and_splits() -> None:
    task = MathTask(sample_path())
    assert isinstance(task, Task) and isinstance(task, SupervisedTask)
    assert len(task.problems) == 20
    assert task.eval_size() == 2
    eval_questions = {task.prompt(i, "eval").text for i in range(task.eval_size())}
    assert len(eval_questions) == 2
    # Train cycles through the other 18 rows once per pass, reshuffled each pass.
    first_pass = [task.prompt(i).text for i in range(18)]
    assert len(set(first_pass)) == 18 and eval_questions.isdisjoint(first_pass)
    assert sorted(task.prompt(i).text for i in range(18, 36)) == sorted(first_pass)
    # problem/solution rows: the answer is the solution's last \boxed{}.
    answers = {p.question: p.answer for p in task.problems}
    assert answers["Simplify \\frac{10}{4}."] == "\\frac{5}{2}"
    # Every reference answer grades as right against itself, boxed.
    for problem in task.problems:
        assert grade_answer(f"The answer is \\boxed{{{problem.answer}}}.", problem.answer) == 1.0


def test_split_and_prompts_are_deterministic_by_seed() -> None:
    a, b, c = MathTask(sample_path(), seed=1), MathTask(sample_path(), seed=1), MathTask(sample_path(), seed=2)
    assert [a.prompt(i) for i in range(40)] == [b.prompt(i) for i in range(40)]
    assert [a.prompt(i).text for i in range(40)] != [c.prompt(i).text for i in range(40)]
    assert MathTask(sample_path(), eval_fraction=0.0).eval_size() == 0
    assert MathTask(sample_path(), eval_fraction=0.5).eval_size() == 10


def test_prompt_template() -> None:
    task = MathTask(sample_path(), prompt_template="Q: {question}\nA:")
    text = task.prompt(0).text
    assert text.startswith("Q: ") and text.endswith("\nA:")
    for bad in ("no field", "{question} {other}"):
        with pytest.raises(ValueError, match="prompt_template"):
            MathTask(sample_path(), prompt_template=bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{56}", "56"),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{7} and a truncated \\boxed{\\frac{1}{", "7"),
        ("\\boxed {5}", "5"),
        ("no box here", None),
        ("\\boxed", None),
    ],
)
def test_last_boxed_balances_braces(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("0.75", "\\frac{3}{4}"),
        ("\\boxed{0.75}", "\\frac{3}{4}"),
        ("so it is \\boxed{\\frac{3}{4}}", "0.75"),
        ("\\boxed{3/4}", "\\frac{3}{4}"),
        ("\\boxed{56}", "56"),
        ("56", "56"),
        ("The answer is 56.", "56"),
        ("first \\boxed{12}, no wait: \\boxed{56}", "56"),
    ],
)
def test_equivalent_forms_are_right(completion: str, answer: str) -> None:
    assert grade_answer(completion, answer) == 1.0


@pytest.mark.parametrize(
    "completion",
    ["57", "\\boxed{57}", "\\boxed{56} no wait \\boxed{57}", "", "   ", "zz?:,", "\\boxed{", "}}}{{{", "\\frac{", "\x00\\boxed{\\frac{1}{0}}",
     "\\boxed{" + "(" * 20 + "}", "\\boxed{" + "{" * 300 + "}" * 300 + "}", "\\boxed{" + "9" * 2000 + "}"],
)
def test_wrong_or_garbage_completions_score_zero_without_raising(completion: str) -> None:
    assert grade_answer(completion, "56") == 0.0


def test_reward_uses_prompt_ids_and_requires_eos() -> None:
    task = MathTask(sample_path())
    index = next(i for i in range(18) if task.answer(i) == "56")
    pid = task.prompt(index).prompt_id
    assert pid == f"train:{index}" and "56" not in pid
    assert task.reward(pid, "\\boxed{56}", finished=True) == 1.0
    assert task.reward(pid, "\\boxed{56}", finished=False) == 0.0
    assert MathTask(sample_path(), require_finished=False).reward(pid, "\\boxed{56}", finished=False) == 1.0
    assert task.reward(pid, "\\boxed{55}", finished=True) == 0.0
    for bad in ("train", "eval:2", "eval:-1", "x:1", "train:1.5"):
        with pytest.raises(ValueError):
            task.reward(bad, "56", finished=True)


def test_grading_off_the_main_thread_still_works() -> None:
    # math_verify's SIGALRM timeouts refuse to run off the main thread; the task must cope.
    results: list[float] = []
    thread = threading.Thread(target=lambda: results.extend([grade_answer("\\boxed{0.75}", "\\frac{3}{4}"), grade_answer("7", "8")]))
    thread.start()
    thread.join(timeout=15)
    assert results == [1.0, 0.0]


def test_bad_files_raise_value_error_naming_file_and_row(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ValueError, match="missing.jsonl"):
        MathTask(missing)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.jsonl.*no problems"):
        MathTask(empty)

    cases = {
        "noanswer.jsonl": [{"question": "1+1?", "answer": "2"}, {"question": "2+2?"}],
        "noquestion.jsonl": [{"question": "1+1?", "answer": "2"}, {"answer": "2"}],
        "nobox.jsonl": [{"problem": "1+1?", "solution": "it is 2"}],
        "emptyanswer.jsonl": [{"question": "1+1?", "answer": "  "}],
    }
    for name, rows in cases.items():
        path = _write_jsonl(tmp_path / name, rows)
        row = len(rows) - 1
        with pytest.raises(ValueError, match=rf"{name}, row {row}: "):
            MathTask(path)

    # datasets reads a line that is no object as a 'text' column, which names no question.
    path = _write_jsonl(tmp_path / "notobject.jsonl", [["1+1?", "2"]])
    with pytest.raises(ValueError, match=r"notobject.jsonl has none of the columns \['question', 'problem'\]"):
        MathTask(path)
    # What datasets itself cannot read is named by file, with the reader's own reason.
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "1+1?", "answer": "2"}\n{"question": \n', encoding="utf-8")
    with pytest.raises(ValueError, match="broken.jsonl: datasets cannot read it"):
        MathTask(broken)

    wrong_type = tmp_path / "problems.csv"
    wrong_type.write_text("question,answer\n", encoding="utf-8")
    with pytest.raises(ValueError, match="problems.csv.*unsupported"):
        MathTask(wrong_type)


def test_numeric_answers_and_field_aliases(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "mixed.jsonl",
        [{"question": "6*7?", "answer": 42}, {"problem": "half of 1?", "solution": "$\\boxed{\\frac{1}{2}}$"}],
    )
    assert [(p.question, p.answer) for p in load_problems(path)] == [("6*7?", "42"), ("half of 1?", "\\frac{1}{2}")]


def test_parquet_and_saved_dataset(tmp_path: Path) -> None:
    rows = [{"question": f"{i}+1?", "answer": str(i + 1)} for i in range(5)]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert [p.answer for p in load_problems(tmp_path / "p.parquet")] == ["1", "2", "3", "4", "5"]

    bad = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": None}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet, row 1"):
        load_problems(tmp_path / "bad.parquet")

    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert MathTask(tmp_path / "ds", eval_fraction=0.2).eval_size() == 1
    # A saved DatasetDict: `split` picks one; a split it lacks is named with the ones it has.
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows)).save_to_disk(str(tmp_path / "dd"))
    assert len(load_problems(tmp_path / "dd")) == 5
    with pytest.raises(ValueError, match=r"split = 'test'.*one split, 'train'"):
        load_problems(tmp_path / "dd", split="test")


def test_missing_optional_readers_name_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    (tmp_path / "ds").mkdir()
    # A None entry in sys.modules makes `import` raise ImportError.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"p.parquet needs the datasets library: pip install 'echo2swarm\[data\]'"):
        load_problems(tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="ds needs the datasets library"):
        load_problems(tmp_path / "ds")

"""Math word problems from a local file, graded with math_verify on the learner.

    JSONL / parquet / datasets.save_to_disk dir ─► rows (question, answer) ─► seeded train/eval split
    prompt: prompt_template.format(question=...)
    reward: last balanced \\boxed{...} of the completion (else the whole completion)
            ─► math_verify.parse ─► verify against the parsed ground truth ─► 1.0 / 0.0

Grading never raises: anything math_verify or sympy throws scores 0.0. math_verify bounds its
parse/verify time with SIGALRM, which only works in the main thread; called from another thread
(e.g. ``asyncio.to_thread``) grading runs without that time bound, and each boxed answer is capped
at ``MAX_ANSWER_CHARS`` to limit the damage of pathological expressions.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from echo2swarm.runtime.logging import get_logger
from echo2swarm.tasks.base import Prompt, check_index, format_prompt_id, parse_prompt_id

__all__ = ["MAX_ANSWER_CHARS", "MathProblem", "MathTask", "grade_answer", "last_boxed", "load_problems", "sample_path"]

logger = get_logger(__name__)

MAX_ANSWER_CHARS: int = 256
"""Longer boxed answers score 0.0 without being parsed (sympy can take seconds on deep nesting)."""

_BOXED = "\\boxed"


@dataclass(frozen=True)
class MathProblem:
    question: str
    answer: str


def sample_path() -> Path:
    """The small sample file shipped with the package (20 short problems)."""
    return Path(str(resources.files("echo2swarm.tasks") / "data" / "math_sample.jsonl"))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or ``None``.

    Escaped braces (``\\{``, ``\\}``) do not count. An unbalanced last box (a truncated completion)
    falls back to the previous balanced one.
    """
    start = text.rfind(_BOXED)
    while start != -1:
        content = _braced(text, start + len(_BOXED))
        if content is not None:
            return content
        start = text.rfind(_BOXED, 0, start)
    return None


def _braced(text: str, pos: int) -> str | None:
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        return None
    depth, i = 0, pos
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, e.g. \{ or \}
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : i]
        i += 1
    return None


def _timeouts() -> dict[str, int | None]:
    # math_verify's SIGALRM timeouts raise in any thread but the main one.
    seconds = 5 if threading.current_thread() is threading.main_thread() else None
    return {"parsing_timeout": seconds, "timeout_seconds": seconds}


@functools.lru_cache(maxsize=65536)
def _parse_gold(answer: str) -> list[Any]:
    from math_verify import parse

    text = answer if _BOXED in answer else f"{_BOXED}{{{answer}}}"
    return parse(text, parsing_timeout=_timeouts()["parsing_timeout"])


def grade_answer(completion: str, answer: str) -> float:
    """1.0 if ``completion`` states ``answer`` (per math_verify), else 0.0; never raises."""
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError as exc:  # a learner without math-verify must fail loudly, not score zeros
        raise RuntimeError("the math task needs math-verify: pip install math-verify") from exc
    try:
        boxed = last_boxed(completion)
        if boxed is not None and len(boxed) > MAX_ANSWER_CHARS:
            return 0.0
        text = completion if boxed is None else f"{_BOXED}{{{boxed}}}"
        timeouts = _timeouts()
        gold = _parse_gold(answer)
        pred = parse(text, parsing_timeout=timeouts["parsing_timeout"])
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeouts["timeout_seconds"]) else 0.0
    except (Exception, TimeoutException) as exc:  # TimeoutException is a BaseException
        logger.debug("grading failed, scoring 0.0: %r", exc)
        return 0.0


# --------------------------------------------------------------------------- loading


def load_problems(path: str | Path) -> list[MathProblem]:
    """Read problems from a JSON Lines file (``.jsonl``, ``.ndjson``, or ``.json`` with one object
    per line), a ``.parquet`` file, or a ``datasets.Dataset.save_to_disk`` directory.

    Rows need ``question`` (or ``problem``) and ``answer`` (or ``solution``, whose last ``\\boxed{}``
    is the answer). Any problem raises ``ValueError`` naming the file and line/row.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"math task data {path} does not exist")
    if path.is_dir():
        rows: Iterator[tuple[str, Mapping[str, Any]]] = _saved_dataset_rows(path)
    elif path.suffix == ".parquet":
        rows = _parquet_rows(path)
    elif path.suffix in (".jsonl", ".ndjson", ".json"):
        rows = _jsonl_rows(path)
    else:
        raise ValueError(
            f"math task data {path}: unsupported format {path.suffix!r}; use .jsonl, .parquet "
            "or a directory written by datasets.Dataset.save_to_disk"
        )
    problems = [_problem(row, where) for where, row in rows]
    if not problems:
        raise ValueError(f"math task data {path} holds no problems")
    return problems


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg}); expected one JSON object per line") from None
            yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs the pyarrow package: pip install pyarrow") from None
    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path}, row {i}", row


def _saved_dataset_rows(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading the dataset directory {path} needs the datasets package: pip install datasets") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ValueError(f"{path} is not a directory written by datasets.Dataset.save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        raise ValueError(f"{path} holds several splits {splits}: point the path at one of them, e.g. {path / splits[0]}")
    for i, row in enumerate(loaded):
        yield f"{path}, row {i}", row


def _problem(row: Any, where: str) -> MathProblem:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected an object with question/answer fields, got {type(row).__name__}")
    question = row.get("question", row.get("problem"))
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: needs a non-empty 'question' (or 'problem') string field")
    answer = row.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: 'answer' must be a string or number, got {type(answer).__name__}")
        answer = str(answer).strip()
    elif isinstance(row.get("solution"), str):
        answer = last_boxed(row["solution"])
        if answer is None:
            raise ValueError(f"{where}: 'solution' has no \\boxed{{...}} final answer")
        answer = answer.strip()
    else:
        raise ValueError(f"{where}: needs an 'answer' (or 'solution' with a \\boxed{{...}} answer) field")
    if not answer:
        raise ValueError(f"{where}: empty answer")
    return MathProblem(question=question, answer=answer)


# --------------------------------------------------------------------------- task


class MathTask:
    """Problems from a local file; the eval split is ``eval_fraction`` of the rows, chosen by ``seed``.

    The train split is unbounded: index ``i`` is position ``i % n_train`` of a permutation of the
    train rows that is reshuffled (seeded) every pass over them. Rows are split as they are: a
    question that appears twice in the file can land on both sides.

    Example::

        task = MathTask(sample_path(), prompt_template="Question: {question}\\nAnswer:")
        p = task.prompt(0)
        task.reward(p.prompt_id, "so the answer is \\\\boxed{56}", finished=True)
    """

    name = "math"

    def __init__(
        self,
        path: str | Path,
        seed: int = 0,
        eval_fraction: float = 0.1,
        prompt_template: str = "{question}",
        require_finished: bool = True,
    ):
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
        try:
            prompt_template.format(question="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"prompt_template may only use the {{question}} field: {exc!r}") from None
        if "{question}" not in prompt_template:
            raise ValueError("prompt_template must contain {question}")
        if importlib.util.find_spec("math_verify") is None:
            raise ModuleNotFoundError("the math task grades answers with math-verify: pip install math-verify")
        self.path = Path(path)
        self.seed = seed
        self.prompt_template = prompt_template
        self.require_finished = require_finished
        self.problems = load_problems(self.path)

        n = len(self.problems)
        order = list(range(n))
        random.Random(f"{seed}:split").shuffle(order)
        n_eval = 0 if eval_fraction == 0 or n < 2 else min(n - 1, max(1, round(n * eval_fraction)))
        self._eval_rows = order[:n_eval]
        self._train_rows = order[n_eval:]
        self._epochs: dict[int, list[int]] = {}
        logger.info("math task: %d problems from %s (%d train, %d eval)", n, self.path, len(self._train_rows), n_eval)

    def _train_epoch(self, epoch: int) -> list[int]:
        rows = self._epochs.get(epoch)
        if rows is None:
            rows = list(self._train_rows)
            random.Random(f"{self.seed}:train:{epoch}").shuffle(rows)
            if len(self._epochs) >= 4:  # leases stay within a pass or two of each other
                self._epochs.clear()
            self._epochs[epoch] = rows
        return rows

    def _row(self, index: int, split: str) -> MathProblem:
        check_index(index, split, len(self._eval_rows))
        if split == "eval":
            return self.problems[self._eval_rows[index]]
        epoch, position = divmod(index, len(self._train_rows))
        return self.problems[self._train_epoch(epoch)[position]]

    def prompt(self, index: int, split: str = "train") -> Prompt:
        problem = self._row(index, split)
        return Prompt(prompt_id=format_prompt_id(split, index), text=self.prompt_template.format(question=problem.question))

    def answer(self, index: int, split: str = "train") -> str:
        return self._row(index, split).answer

    def eval_size(self) -> int:
        return len(self._eval_rows)

    def reward(self, prompt_id: str, completion: str, finished: bool) -> float:
        split, index = parse_prompt_id(prompt_id)
        answer = self._row(index, split).answer
        if self.require_finished and not finished:
            return 0.0
        return grade_answer(completion, answer)

    def __repr__(self) -> str:
        return f"MathTask(path={str(self.path)!r}, seed={self.seed!r}, eval_size={self.eval_size()})"

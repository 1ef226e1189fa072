"""Math problems from local files, read through the `datasets` library (offline: never the hub).

    path ─► a file:   load_dataset("json" | "parquet", data_files=path)       one split, "train"
            a folder: load_from_disk(path)                 when save_to_disk wrote it
                      load_dataset(<format>, data_dir=path) otherwise: split-named files, the Hub's
                                                            layout (train-00000-of-00001.parquet, test-...)
         ─► the split named by ``split`` ─► rows ─► MathProblem(question, final answer)

Final answers: GSM8K's ``"... #### 72"`` gives ``"72"`` (thousands separators dropped), a text with
a ``\\boxed{}`` gives its last box (MATH's solutions), anything else is the answer as written. A
``solution`` column must mark its answer one of those two ways.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2swarm.runtime.logging import get_logger

__all__ = ["MathProblem", "final_answer", "last_boxed", "load_problems", "load_split"]

logger = get_logger(__name__)

_BOXED = "\\boxed"
_HASHES = "####"
_FORMATS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet"}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


@dataclass(frozen=True)
class MathProblem:
    question: str
    answer: str


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


def final_answer(text: str) -> str | None:
    """The marked final answer of a worked solution: what follows its last ``####`` (GSM8K; up to
    the end of that line, ``"1,000"`` read as ``"1000"``) or its last ``\\boxed{}``, whichever
    comes later; ``None`` when neither marks one."""
    boxed_at, hashes_at = text.rfind(_BOXED), text.rfind(_HASHES)
    if hashes_at > boxed_at:
        tail = text[hashes_at + len(_HASHES):].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        return _THOUSANDS.sub("", line) or None
    return last_boxed(text)


# --------------------------------------------------------------------------- loading


def _datasets(path: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading {path} needs the datasets library: pip install 'echo2swarm[data]' "
                         "(or pip install datasets pyarrow)") from None
    datasets.disable_progress_bars()
    return datasets


def _folder_format(path: Path) -> str:
    found = {_FORMATS[p.suffix] for p in path.rglob("*") if p.suffix in _FORMATS and p.is_file()}
    if len(found) != 1:
        raise ValueError(
            f"math task data {path}: a folder must hold .parquet or .jsonl files (named by split, e.g. "
            f"train-00000-of-00001.parquet), or be written by datasets' save_to_disk; found "
            f"{'both kinds' if found else 'neither'}"
        )
    return found.pop()


def load_split(path: str | Path, split: str = "train", cache_dir: str | Path | None = None) -> Any:
    """The ``split`` of the data at ``path`` as a ``datasets.Dataset`` (see the module docstring).

    ``cache_dir``: where datasets writes its Arrow cache (None: its default, ``HF_DATASETS_CACHE``).
    Raises ``ValueError`` naming the file, or the ``split`` option and the splits there are.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"math task data {path} does not exist")
    datasets = _datasets(path)
    saved = path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists())
    if path.is_file() and path.suffix not in _FORMATS:
        raise ValueError(
            f"math task data {path}: unsupported format {path.suffix!r}; use .jsonl, .parquet, a folder of "
            "them named by split, or a folder written by datasets' save_to_disk"
        )
    builder = _FORMATS[path.suffix] if path.is_file() else None if saved else _folder_format(path)
    try:
        if builder is None:
            loaded = datasets.load_from_disk(str(path))
        else:
            where = {"data_files": str(path)} if path.is_file() else {"data_dir": str(path)}
            loaded = datasets.load_dataset(builder, **where, cache_dir=None if cache_dir is None else str(cache_dir))
    except Exception as exc:  # datasets wraps the reader's error (pyarrow, JSON) in its own
        if path.is_file() and builder == "json" and not path.read_text(encoding="utf-8", errors="replace").strip():
            raise ValueError(f"math task data {path} holds no problems") from None
        cause = exc.__cause__ or exc
        raise ValueError(f"math task data {path}: datasets cannot read it ({type(cause).__name__}: {cause})") from None
    if not isinstance(loaded, datasets.DatasetDict):  # save_to_disk of one Dataset: no split names
        loaded = datasets.DatasetDict(train=loaded)
    if split not in loaded:
        if path.is_file() or list(loaded) == ["train"]:
            raise ValueError(f"split = {split!r}: {path} holds one split, 'train'; to train and evaluate on separate "
                             "files, give a folder with one file per split (train-....parquet, test-....parquet)")
        raise ValueError(f"split = {split!r}: {path} holds the splits {sorted(loaded)}; set split (and eval_split) "
                         "to one of them")
    return loaded[split]


def _columns(columns: list[str], given: str | None, option: str, defaults: tuple[str, ...], where: Path) -> list[str]:
    """The columns to read a field from, in order of preference: the one the option names, or the defaults present."""
    if given is not None:
        if given not in columns:
            raise ValueError(f"{option} = {given!r}: {where} has no such column; its columns are {columns}")
        return [given]
    found = [name for name in defaults if name in columns]
    if not found:
        raise ValueError(f"{where} has none of the columns {list(defaults)}; its columns are {columns}: "
                         f"set {option} to the one to use")
    return found


def load_problems(
    path: str | Path,
    *,
    split: str = "train",
    question_field: str | None = None,
    answer_field: str | None = None,
    cache_dir: str | Path | None = None,
) -> list[MathProblem]:
    """Problems of ``split`` at ``path``.

    Columns: ``question_field`` (default: ``question``, or ``problem`` where a row has no question)
    and ``answer_field`` (default: ``answer``, or ``solution`` where a row has no answer). Any bad
    row raises ``ValueError`` naming the file and row (0-based).
    """
    path = Path(path)
    dataset = load_split(path, split, cache_dir)
    columns = list(dataset.column_names)
    questions = _columns(columns, question_field, "question_field", ("question", "problem"), path)
    answers = _columns(columns, answer_field, "answer_field", ("answer", "solution"), path)
    where = str(path) if split == "train" else f"{path}, split {split!r}"
    problems = [_problem(row, f"{where}, row {i}", questions, answers)
                for i, row in enumerate(dataset.select_columns(questions + answers))]
    if not problems:
        raise ValueError(f"math task data {where} holds no problems")
    return problems


def _first(row: Mapping[str, Any], columns: list[str]) -> tuple[str, Any]:
    for column in columns:
        if row.get(column) is not None:
            return column, row[column]
    return columns[0], None


def _problem(row: Mapping[str, Any], where: str, questions: list[str], answers: list[str]) -> MathProblem:
    named = " or ".join(repr(c) for c in questions)
    _, question = _first(row, questions)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: needs a non-empty {named} string")
    column, value = _first(row, answers)
    if value is None:
        raise ValueError(f"{where}: needs an {' or '.join(repr(c) for c in answers)}")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: {column!r} must be a string or number, got {type(value).__name__}")
    text = str(value).strip()
    answer = final_answer(text)
    if answer is None:
        if column == "solution":
            raise ValueError(f"{where}: 'solution' marks no final answer (\\boxed{{...}} or '#### ...')")
        answer = text
    answer = answer.strip()
    if not answer:
        raise ValueError(f"{where}: empty answer in {column!r}")
    return MathProblem(question=question, answer=answer)

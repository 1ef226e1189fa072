"""Math word problems from local files, graded with math_verify on the learner.

    JSONL / parquet / a folder of them / datasets.save_to_disk dir
        ─► datasets (tasks/problems.py) ─► rows (question, final answer) ─► seeded train/eval split
    prompt: prompt_template.format(question=...), in the tokenizer's chat format when it has one
            (tasks/chat.py; needs the ``tokenizer`` option)
    reward: the completion's last balanced \\boxed{...}, else what follows its last "####" (GSM8K),
            else the whole completion ─► math_verify.parse ─► verify against the parsed reference
            ─► 1.0 / 0.0

Grading never raises: anything math_verify or sympy throws scores 0.0. math_verify bounds its
parse/verify time with SIGALRM, which only works in the main thread; called from another thread
(e.g. ``asyncio.to_thread``) grading runs without that time bound, and each extracted answer is
capped at ``MAX_ANSWER_CHARS`` to limit the damage of pathological expressions.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from echo2swarm.runtime.logging import get_logger
from echo2swarm.tasks.base import EpochShuffle, Prompt, check_index, format_prompt_id, parse_prompt_id
from echo2swarm.tasks.chat import ChatFormatter, load_tokenizer
from echo2swarm.tasks.problems import MathProblem, final_answer, last_boxed, load_problems

__all__ = ["MAX_ANSWER_CHARS", "MathProblem", "MathTask", "grade_answer", "last_boxed", "load_problems", "sample_path"]

logger = get_logger(__name__)

MAX_ANSWER_CHARS: int = 256
"""Longer final answers score 0.0 without being parsed (sympy can take seconds on deep nesting)."""

_BOXED = "\\boxed"


def sample_path() -> Path:
    """The small sample file shipped with the package (20 short problems)."""
    return Path(str(resources.files("echo2swarm.tasks") / "data" / "math_sample.jsonl"))


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
    """1.0 if ``completion`` states ``answer`` (per math_verify), else 0.0; never raises.

    The completion's final answer is its last ``\\boxed{}`` or what follows its last ``####``,
    whichever comes later; without either, math_verify looks at the whole completion.
    """
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError as exc:  # a learner without math-verify must fail loudly, not score zeros
        raise RuntimeError("the math task needs math-verify: pip install math-verify") from exc
    try:
        stated = final_answer(completion)
        if stated is not None and len(stated) > MAX_ANSWER_CHARS:
            return 0.0
        text = completion if stated is None else f"{_BOXED}{{{stated}}}"
        timeouts = _timeouts()
        gold = _parse_gold(answer)
        pred = parse(text, parsing_timeout=timeouts["parsing_timeout"])
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeouts["timeout_seconds"]) else 0.0
    except (Exception, TimeoutException) as exc:  # TimeoutException is a BaseException
        logger.debug("grading failed, scoring 0.0: %r", exc)
        return 0.0


# --------------------------------------------------------------------------- task


def _optional_str(value: object, option: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{option} must be a non-empty string, got {value!r}")
    return value


class MathTask:
    """Problems from local files; the eval split is ``eval_fraction`` of the rows (chosen by ``seed``)
    or a split of its own (``eval_split``, e.g. GSM8K's ``test``).

    The train split is unbounded: index ``i`` is position ``i % n_train`` of a permutation of the
    train rows that is reshuffled (seeded) every pass over them. Rows are split as they are: a
    question that appears twice in the file can land on both sides.

    Options: ``split`` / ``eval_split`` name the data's splits (a single file has one, ``train``);
    ``question_field`` / ``answer_field`` its columns (default ``question`` or ``problem``,
    ``answer`` or ``solution``); ``cache_dir`` where datasets keeps its Arrow cache. With
    ``tokenizer`` (the model's local directory), prompts are put in its chat format when it has a
    chat template (``chat_template = true`` requires one, ``false`` never uses it), after an
    optional ``system_prompt``.

    Example::

        task = MathTask("gsm8k/main", split="train", eval_split="test", tokenizer="models/qwen3-0.6b",
                        prompt_template="{question}\\nEnd with '#### <answer>'.")
        p = task.prompt(0)
        task.reward(p.prompt_id, "... #### 72", finished=True)
    """

    name = "math"

    def __init__(
        self,
        path: str | Path,
        seed: int = 0,
        eval_fraction: float | None = None,
        prompt_template: str = "{question}",
        require_finished: bool = True,
        question_field: str | None = None,
        answer_field: str | None = None,
        split: str = "train",
        eval_split: str | None = None,
        tokenizer: str | Path | Any | None = None,
        chat_template: bool | None = None,
        system_prompt: str | None = None,
        cache_dir: str | Path | None = None,
    ):
        if eval_fraction is None:
            eval_fraction = 0.1 if eval_split is None else 0.0
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
        _optional_str(split, "split")
        if _optional_str(eval_split, "eval_split") is not None:
            if eval_fraction:
                raise ValueError("set eval_fraction or eval_split, not both: the held-out problems come from one of them")
            if eval_split == split:
                raise ValueError(f"eval_split = {eval_split!r} is the training split too; name another split")
        try:
            prompt_template.format(question="")
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ValueError(f"prompt_template may only use the {{question}} field: {exc!r}") from None
        if "{question}" not in prompt_template:
            raise ValueError("prompt_template must contain {question}")
        if not isinstance(require_finished, bool):
            raise ValueError(f"require_finished must be true or false, got {require_finished!r}")
        if importlib.util.find_spec("math_verify") is None:
            raise ModuleNotFoundError("the math task grades answers with math-verify: pip install math-verify")
        self.chat = self._chat(tokenizer, chat_template, _optional_str(system_prompt, "system_prompt"))
        self.path = Path(path)
        self.seed = seed
        self.prompt_template = prompt_template
        self.require_finished = require_finished
        fields = {"question_field": _optional_str(question_field, "question_field"),
                  "answer_field": _optional_str(answer_field, "answer_field"), "cache_dir": cache_dir}
        self.problems = load_problems(self.path, split=split, **fields)
        n = len(self.problems)
        if eval_split is not None:
            held_out = load_problems(self.path, split=eval_split, **fields)
            self.problems = self.problems + held_out
            self._train_rows, self._eval_rows = list(range(n)), list(range(n, n + len(held_out)))
        else:
            order = list(range(n))
            random.Random(f"{seed}:split").shuffle(order)
            n_eval = 0 if eval_fraction == 0 or n < 2 else min(n - 1, max(1, round(n * eval_fraction)))
            self._eval_rows, self._train_rows = order[:n_eval], order[n_eval:]
        self._train_order = EpochShuffle(self._train_rows, key=f"{seed}:train")
        logger.info("math task: %d problems from %s (%d train, %d eval)%s", len(self.problems), self.path,
                    len(self._train_rows), len(self._eval_rows), ", chat-formatted" if self.chat else "")

    @staticmethod
    def _chat(tokenizer: Any, chat_template: bool | None, system_prompt: str | None) -> ChatFormatter | None:
        if chat_template is not None and not isinstance(chat_template, bool):
            raise ValueError(f"chat_template must be true, false or unset (use it when the tokenizer has one), got {chat_template!r}")
        if tokenizer is None:
            if chat_template or system_prompt is not None:
                raise ValueError("chat_template and system_prompt need the tokenizer option: the model's local directory")
            return None
        loaded = load_tokenizer(tokenizer)
        has_template = bool(getattr(loaded, "chat_template", None))
        if chat_template is False or (chat_template is None and not has_template):
            if system_prompt is not None:
                raise ValueError("system_prompt needs a chat template, and none is in use (chat_template = false, "
                                 "or the tokenizer has none)")
            return None
        if not has_template:
            raise ValueError(f"chat_template = true, but the tokenizer from {tokenizer!r} has no chat template")
        return ChatFormatter(loaded, system_prompt=system_prompt)

    def _row(self, index: int, split: str) -> MathProblem:
        check_index(index, split, len(self._eval_rows))
        if split == "eval":
            return self.problems[self._eval_rows[index]]
        return self.problems[self._train_order[index]]

    def prompt(self, index: int, split: str = "train") -> Prompt:
        text = self.prompt_template.format(question=self._row(index, split).question)
        return Prompt(prompt_id=format_prompt_id(split, index), text=self.chat(text) if self.chat else text)

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

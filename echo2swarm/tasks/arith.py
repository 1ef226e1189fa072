"""Two-number addition, the task the tiny model can learn on two CPU cores.

    prompt "12+30="  ─►  reward 1.0 iff the completion is "42" (surrounding whitespace ignored)
                          and ended with EOS, else 0.0

Operands of prompt ``index`` come from ``random.Random(f"{seed}:{split}:{index}")``, so any prompt
is reproducible from its id alone, without state.

Eval split: ``EVAL_SIZE`` (200) prompts. When the operand space holds at least twice as many
pairs, the eval pairs are distinct and the train split never produces any of them (a train draw
that hits an eval pair is redrawn from the same stream), so eval accuracy is held-out accuracy.
With a smaller space (``max_operand < 19``) that is impossible: eval pairs repeat and overlap train.
"""

from __future__ import annotations

import random

from echo2swarm.runtime.logging import get_logger
from echo2swarm.tasks.base import Prompt, check_index, format_prompt_id, parse_prompt_id

__all__ = ["EVAL_SIZE", "ArithTask"]

logger = get_logger(__name__)

EVAL_SIZE: int = 200


class ArithTask:
    """``a+b=`` with ``0 <= a, b <= max_operand``.

    Example::

        task = ArithTask(seed=0)
        p = task.prompt(17)                  # Prompt(prompt_id="train:17", text="..+..=")
        task.reward(p.prompt_id, task.answer(17), finished=True)   # 1.0
    """

    name = "arith"

    def __init__(self, seed: int = 0, max_operand: int = 99):
        if isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 1:
            raise ValueError(f"max_operand must be an int >= 1, got {max_operand!r}")
        self.seed = seed
        self.max_operand = max_operand
        pairs = (max_operand + 1) ** 2
        self.disjoint = pairs >= 2 * EVAL_SIZE
        self._eval_pairs = self._draw_eval_pairs()
        self._eval_set = frozenset(self._eval_pairs) if self.disjoint else frozenset()
        if not self.disjoint:
            logger.info("arith max_operand=%d: only %d operand pairs, eval prompts repeat and overlap train", max_operand, pairs)

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)

    def _draw_eval_pairs(self) -> list[tuple[int, int]]:
        if not self.disjoint:
            return [self._draw(random.Random(f"{self.seed}:eval:{i}")) for i in range(EVAL_SIZE)]
        rng = random.Random(f"{self.seed}:eval")
        pairs: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        while len(pairs) < EVAL_SIZE:
            pair = self._draw(rng)
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
        return pairs

    def operands(self, index: int, split: str = "train") -> tuple[int, int]:
        check_index(index, split, EVAL_SIZE)
        if split == "eval":
            return self._eval_pairs[index]
        rng = random.Random(f"{self.seed}:train:{index}")
        pair = self._draw(rng)
        # At most half the space is excluded, so this ends after ~2 draws in the worst case.
        while pair in self._eval_set:
            pair = self._draw(rng)
        return pair

    def prompt(self, index: int, split: str = "train") -> Prompt:
        a, b = self.operands(index, split)
        return Prompt(prompt_id=format_prompt_id(split, index), text=f"{a}+{b}=")

    def answer(self, index: int, split: str = "train") -> str:
        a, b = self.operands(index, split)
        return str(a + b)

    def eval_size(self) -> int:
        return EVAL_SIZE

    def reward(self, prompt_id: str, completion: str, finished: bool) -> float:
        split, index = parse_prompt_id(prompt_id)
        answer = self.answer(index, split)
        return 1.0 if finished and completion.strip() == answer else 0.0

    def __repr__(self) -> str:
        return f"ArithTask(seed={self.seed!r}, max_operand={self.max_operand})"

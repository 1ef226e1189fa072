"""Poker, ECHO-2's second task: one decision in a no-limit hold'em spot, rewarded by its chip EV.

    pool of spots (data/poker_spots.jsonl; built with pokerkit by tasks/poker_spots.py)
    prompt:     "hand jd 9s board kd ks js 7d 3s pot 120 call 60 price 33 stack 224 villain top 20 action:"
    completion: "fold" | "call" | "raise", or "f" | "c" | "r"  (case, blanks and a final "." ignored),
                then EOS; ``answers`` picks which the warm-up teaches (letters for the demo's tiny model)
    reward:     the action's chip EV against the stated range, mapped linearly onto [0, 1]:
                1 for the EV-best action, 0 for the worst; anything else (or no EOS) 0.0

The EV model (villain uniform over the top N % of starting hands, calls a pot-size raise with all
of it, no betting after the decision) is in tasks/poker_spots.py and docs/tasks.md. Spots are
valued once, when the pool is generated (0.1-0.3 s each), so a reward is a table look-up.

Eval split: the pool's eval spots, drawn from seeds of their own (``poker:<seed>:eval:<i>``), so
held-out in construction. Train split: unbounded; index ``i`` is position ``i % n_train`` of a
permutation of the train spots that is reshuffled (by ``seed``) every pass.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from echo2swarm.runtime.logging import get_logger
from echo2swarm.tasks.base import EpochShuffle, Prompt, check_index, format_prompt_id, parse_prompt_id

__all__ = ["ACTIONS", "ANSWER_FORMATS", "STREETS", "PokerTask", "Spot", "parse_action", "read_spots", "spots_path"]

logger = get_logger(__name__)

ACTIONS: tuple[str, ...] = ("fold", "call", "raise")
STREETS: tuple[str, ...] = ("preflop", "flop", "turn", "river")
_CARDS = re.compile(r"[2-9tjqka][cdhs]( [2-9tjqka][cdhs])*")
_BOARD_SIZE = {"preflop": 0, "flop": 3, "turn": 4, "river": 5}
_RANK_ORDER = "akqjt98765432"


def _ranked(cards: str) -> str:
    return " ".join(sorted(cards.split(), key=lambda c: (_RANK_ORDER.index(c[0]), c[1])))


def spots_path() -> Path:
    """The pool shipped with the package: 400 eval and 3000 train spots, generator seed 0."""
    return Path(str(resources.files("echo2swarm.tasks") / "data" / "poker_spots.jsonl"))


@dataclass(frozen=True)
class Spot:
    """One decision: the hero faces a bet and may fold, call or raise.

    Example::

        spot = PokerTask().spot(0, "eval")
        spot.prompt()        # 'hand td 7h board none pot 10 call 6 price 38 stack 198 villain top 15 action:'
        spot.best_action()   # 'fold'
        spot.rewards()       # {'fold': 1.0, 'call': 0.85, 'raise': 0.0}
    """

    split: str
    index: int
    street: str
    hero: str
    """The hero's hole cards, e.g. ``"kh qh"`` (lower case: the tiny model's vocabulary)."""
    board: str
    """Board cards, ``""`` before the flop."""
    pot: int
    """Chips in the middle, the villain's bet included."""
    call: int
    """Chips the hero must put in to call."""
    stack: int
    """The hero's chips behind, before calling."""
    range_pct: int
    """The villain's range: the top ``range_pct`` % of starting hands (`poker_spots.range_combos`)."""
    equity: float
    """The hero's showdown share against that range (ties split)."""
    evs: dict[str, float]
    """Chip EV of each of `ACTIONS`, relative to folding."""

    def price(self) -> int:
        """The equity a call needs, in % (rounded): call / (pot + call)."""
        return round(100 * self.call / (self.pot + self.call))

    def prompt(self) -> str:
        """Cards high rank first (the order of hole cards and of board cards carries nothing), then
        the money and the villain's range."""
        return (f"hand {_ranked(self.hero)} board {_ranked(self.board) or 'none'} pot {self.pot} call {self.call} "
                f"price {self.price()} stack {self.stack} villain top {self.range_pct} action:")

    def best_action(self) -> str:
        """The EV-best action; ties go to the more passive one (fold, then call)."""
        return max(ACTIONS, key=lambda a: (self.evs[a], -ACTIONS.index(a)))

    def rewards(self) -> dict[str, float]:
        """Each action's EV mapped linearly onto [0, 1]: 1 for the best, 0 for the worst; all 1 when
        every action is worth the same (within 0.001 chip)."""
        low, high = min(self.evs.values()), max(self.evs.values())
        if high - low < 1e-3:
            return {a: 1.0 for a in ACTIONS}
        return {a: (self.evs[a] - low) / (high - low) for a in ACTIONS}

    def check(self) -> None:
        """Raise ``ValueError`` unless the fields describe a possible spot."""
        if self.split not in ("train", "eval") or self.street not in STREETS:
            raise ValueError(f"split {self.split!r} or street {self.street!r} unknown")
        if not _CARDS.fullmatch(self.hero) or len(self.hero.split()) != 2:
            raise ValueError(f"hero must be two cards like 'kh qh', got {self.hero!r}")
        board = self.board.split()
        if len(board) != _BOARD_SIZE[self.street] or (board and not _CARDS.fullmatch(self.board)):
            raise ValueError(f"a {self.street} board has {_BOARD_SIZE[self.street]} cards, got {self.board!r}")
        if len(set(board + self.hero.split())) != len(board) + 2:
            raise ValueError("a card repeats between the hero's hand and the board")
        ints = (self.index, self.pot, self.call, self.stack, self.range_pct)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints) or not 1 <= self.range_pct <= 100:
            raise ValueError("index, pot, call and stack must be ints >= 0 and range_pct in [1, 100]")
        if not 0.0 <= self.equity <= 1.0:
            raise ValueError(f"equity {self.equity!r} outside [0, 1]")
        if set(self.evs) != set(ACTIONS) or not all(isinstance(v, (int, float)) for v in self.evs.values()):
            raise ValueError(f"evs needs a number for each of {ACTIONS}")


def read_spots(path: str | Path) -> list[Spot]:
    """Spots from a JSON Lines file written by `poker_spots.write_spots`; ``ValueError`` naming the line."""
    path = Path(path)
    spots = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"poker spots {path}: cannot read it ({exc})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            spot = Spot(**json.loads(line))
            spot.check()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}, line {lineno}: not a poker spot ({exc})") from None
        spots.append(spot)
    return spots


ANSWER_FORMATS: dict[str, dict[str, str]] = {
    "words": {a: a for a in ACTIONS},
    "letters": {a: a[0] for a in ACTIONS},
}
"""How the warm-up target (`PokerTask.answer`) spells each action. A character-level model spells
"call" and "fold" with the same third letter, and RL drifts it to "cald"; one letter cannot."""

_SPELLINGS = {spelling: action for format_ in ANSWER_FORMATS.values() for action, spelling in format_.items()}


def parse_action(completion: str) -> str | None:
    """The action the completion names, if that is all it says: ``"fold"`` / ``"f"``, ``"call"`` /
    ``"c"``, ``"raise"`` / ``"r"`` (case, surrounding blanks and a final ``"."`` aside), else ``None``."""
    return _SPELLINGS.get(completion.strip().lower().removesuffix(".").strip())


class PokerTask:
    """Decisions in no-limit hold'em spots from a pool (by default the one shipped with the package).

    Example::

        task = PokerTask(seed=0)
        p = task.prompt(17)                  # Prompt(prompt_id="train:17", text="hand ... action:")
        task.reward(p.prompt_id, task.answer(17), finished=True)    # 1.0: the EV-best action
    """

    name = "poker"

    def __init__(
        self, seed: int = 0, spots: str | Path | None = None, require_finished: bool = True, answers: str = "words"
    ):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if answers not in ANSWER_FORMATS:
            raise ValueError(f"answers must be one of {', '.join(ANSWER_FORMATS)}, got {answers!r}")
        self.answers = answers
        if not isinstance(require_finished, bool):
            raise ValueError(f"require_finished must be true or false, got {require_finished!r}")
        self.seed = seed
        self.require_finished = require_finished
        self.path = spots_path() if spots is None else Path(spots)
        if not self.path.is_file():
            raise ValueError(f"spots = {str(self.path)!r} is not a file; generate one with "
                             "python -m echo2swarm.tasks.poker_spots OUT.jsonl, or leave spots unset for the shipped pool")
        pool = read_spots(self.path)
        self._train = [s for s in pool if s.split == "train"]
        self._eval = [s for s in pool if s.split == "eval"]
        if not self._train or not self._eval:
            raise ValueError(f"spots = {str(self.path)!r} needs train and eval spots; it has "
                             f"{len(self._train)} train and {len(self._eval)} eval")
        # Rewards are computed once here: the learner's reward() is then a look-up.
        self._rewards = {(s.split, s.index): s.rewards() for s in pool}
        if len(self._rewards) != len(pool):
            raise ValueError(f"spots = {str(self.path)!r}: two spots share a split and index")
        self._train_order = EpochShuffle(self._train, key=f"{seed}:poker:train")
        logger.info("poker task: %d train and %d eval spots from %s", len(self._train), len(self._eval), self.path)

    def spot(self, index: int, split: str = "train") -> Spot:
        check_index(index, split, len(self._eval))
        if split == "eval":
            return self._eval[index]
        return self._train_order[index]

    def prompt(self, index: int, split: str = "train") -> Prompt:
        return Prompt(prompt_id=format_prompt_id(split, index), text=self.spot(index, split).prompt())

    def answer(self, index: int, split: str = "train") -> str:
        """The EV-best action, spelt as ``answers`` says: the warm-up's supervised target."""
        return ANSWER_FORMATS[self.answers][self.spot(index, split).best_action()]

    def eval_size(self) -> int:
        return len(self._eval)

    def reward(self, prompt_id: str, completion: str, finished: bool) -> float:
        split, index = parse_prompt_id(prompt_id)
        spot = self.spot(index, split)
        action = parse_action(completion)
        if action is None or (self.require_finished and not finished):
            return 0.0
        return self._rewards[(spot.split, spot.index)][action]

    def __repr__(self) -> str:
        return (f"PokerTask(seed={self.seed!r}, spots={str(self.path)!r}, answers={self.answers!r}, "
                f"train={len(self._train)}, eval={len(self._eval)})")

"""No-limit hold'em spots for the poker task: built with pokerkit, valued against a stated range.

    (seed, split, index) ─► random.Random ─► stacks, street, earlier action, cards
        ─► pokerkit State (heads-up no-limit hold'em, blinds 1/2): villain bets, hero to act
        ─► the hero's view: pot, amount to call, stack behind, whether a raise is legal
        ─► equity of the hero's hand against the villain's stated range (pokerkit's evaluator:
           exact on the river, seeded Monte-Carlo before it)
        ─► chip EV of fold / call / raise, reading what each action puts in and wins off the State

The value model (docs/tasks.md says why):

- The villain's hand is uniform over the combos of the top ``range_pct`` % of starting hands
  (ranked by equity against a random hand, `PREFLOP_EQUITY`), less the combos the hero's cards
  and the board block. The range is what the prompt states; the betting does not narrow it.
- fold: 0 (what is already in the pot is sunk).
- call: the board runs out with no more betting; EV = equity x pot after the call - chips called.
- raise: a pot-size raise (all-in when the stack is shorter), which the villain calls with his
  whole range (no fold equity); then as for a call. Where the bet already covers the hero's
  stack no raise is legal, and "raise" is the all-in call.

So call beats fold iff equity > call / (pot + call) (pot odds) and raise beats call iff
equity > 1/2. The chips each action puts in and the pot it builds are read off a pokerkit State
after the action (and the villain's call). Building one spot costs 0.05-0.3 s of pure-Python hand
evaluation, so the task reads a pool generated once (``python -m echo2swarm.tasks.poker_spots
OUT.jsonl``; the shipped one is ``data/poker_spots.jsonl``) and its reward is a table look-up.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from functools import lru_cache
from itertools import combinations
from pathlib import Path
from typing import TextIO

from pokerkit import Automation, Card, Deck, Mode, NoLimitTexasHoldem, StandardHighHand, State

from echo2swarm.tasks.poker import STREETS, Spot

__all__ = [
    "PREFLOP_EQUITY", "RANGE_PCTS", "card_text", "class_equity", "equity", "generate_spot", "hand_strength",
    "parse_cards", "preflop_classes", "range_combos", "write_spots",
]

RANGE_PCTS: tuple[int, ...] = (5, 10, 15, 20, 30, 40, 50, 70, 100)
"""The villain ranges a generated spot states: the top N % of the 1326 starting combos."""

BLINDS: tuple[int, int] = (1, 2)
DECK: tuple[Card, ...] = tuple(Deck.STANDARD)  # 2c 2d 2h 2s 3c ... As: a fixed order, so draws are seeded
_RANKS = "23456789tjqka"
_LOOKUP = StandardHighHand.lookup
_AUTOMATIONS = (
    # Only the bookkeeping: no CARD_BURNING (an automated burn draws a real card from the state's deck,
    # maybe one this spot deals later; `_deal_board` burns an unknown card "??"), and nothing past the
    # betting, so a river call stops at the showdown with the pot still in the middle to read.
    Automation.ANTE_POSTING, Automation.BET_COLLECTION, Automation.BLIND_OR_STRADDLE_POSTING,
)
# Heads-up in pokerkit: player 0 posts the big blind and acts first after the flop, player 1 is the
# button (small blind) and acts first before it. The villain is whoever bets first on the spot's street.
_BB, _BUTTON = 0, 1


# --------------------------------------------------------------------------- cards and hands


def card_text(card: Card) -> str:
    """``"ah"``, ``"th"``, ``"2c"``: lower case, so the tiny model's character vocabulary holds it."""
    return repr(card).lower()


def parse_cards(text: str) -> tuple[Card, ...]:
    """``"ah kd"`` (any case, spaces optional) to pokerkit cards; ``ValueError`` on anything else."""
    compact = text.replace(" ", "")
    if len(compact) % 2 or any(compact[i].lower() not in _RANKS or compact[i + 1].lower() not in "cdhs"
                               for i in range(0, len(compact), 2)):
        raise ValueError(f"not a list of cards like 'ah kd': {text!r}")
    return tuple(next(iter(Card.parse(compact[i].upper() + compact[i + 1].lower()))) for i in range(0, len(compact), 2))


# pokerkit keys a five-card hand by the product of one prime per rank and whether all five share a
# suit; hands with equal keys are equal. Its key computation (Card.clean, get_suits) is most of the
# cost of a look-up, so the hot loops work on card ids (positions in DECK), compute the same key
# from per-id tables, and look each key up in pokerkit once (7462 keys in all).
_PRIMES = dict(zip("23456789TJQKA", (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)))
_ID = {card: i for i, card in enumerate(DECK)}
_PRIME = [_PRIMES[repr(card)[0]] for card in DECK]
_SUIT = [repr(card)[1] for card in DECK]
_STRENGTH: dict[tuple[int, bool], int] = {}


def _five(five: tuple[int, ...]) -> int:
    a, b, c, d, e = five
    suit = _SUIT
    key = (_PRIME[a] * _PRIME[b] * _PRIME[c] * _PRIME[d] * _PRIME[e], suit[a] == suit[b] == suit[c] == suit[d] == suit[e])
    strength = _STRENGTH.get(key)
    if strength is None:
        strength = _STRENGTH[key] = _LOOKUP.get_entry(tuple(DECK[i] for i in five)).index
    return strength


def _strength(ids: tuple[int, ...]) -> int:
    return max(map(_five, combinations(ids, 5)))


def hand_strength(cards: Sequence[Card]) -> int:
    """Strength of the best five of ``cards`` (5 to 7) per pokerkit's standard high-hand lookup;
    greater is stronger, equal is a tie."""
    return _strength(tuple(_ID[c] for c in cards))


# --------------------------------------------------------------------------- ranges


def preflop_classes() -> list[tuple[str, tuple[tuple[Card, Card], ...]]]:
    """The 169 starting-hand classes (``"aa"``, ``"aks"``, ``"ako"``, ...) and their combos in deck order."""
    classes: dict[str, list[tuple[Card, Card]]] = {}
    for a, b in combinations(DECK, 2):  # deck order: b's rank >= a's rank
        hi, lo = b, a
        ranks = card_text(hi)[0] + card_text(lo)[0]
        name = ranks if ranks[0] == ranks[1] else ranks + ("s" if hi.suit == lo.suit else "o")
        classes.setdefault(name, []).append((hi, lo))
    return [(name, tuple(combos)) for name, combos in classes.items()]


def class_equity(name: str, samples: int, seed: int = 0) -> float:
    """Equity of starting-hand class ``name`` against a uniformly random hand, by seeded Monte-Carlo
    (how `PREFLOP_EQUITY` was made: ``samples=20000, seed=0``)."""
    combos = dict(preflop_classes())[name]
    rng = random.Random(f"preflop:{seed}:{name}")
    hero = combos[0]
    everyone = [c for c in combinations(DECK, 2) if not set(c) & set(hero)]
    return equity(hero, (), everyone, samples, rng)


@lru_cache(maxsize=len(RANGE_PCTS) + 8)
def range_combos(pct: int) -> tuple[tuple[Card, Card], ...]:
    """The top ``pct`` % of the 1326 combos by `PREFLOP_EQUITY`: whole classes, best first, until
    at least that share is in (so "top 5" is 5.4 %: 72 combos, AA down to the class that crosses 5 %)."""
    if isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 100:
        raise ValueError(f"range_pct must be an int in [1, 100], got {pct!r}")
    by_name = dict(preflop_classes())
    order = sorted(by_name, key=lambda n: (-PREFLOP_EQUITY[n], n))
    target = pct * 1326 / 100
    out: list[tuple[Card, Card]] = []
    for name in order:
        if len(out) >= target:
            break
        out.extend(by_name[name])
    return tuple(out)


# --------------------------------------------------------------------------- equity


def equity(
    hero: Sequence[Card], board: Sequence[Card], villain: Sequence[tuple[Card, Card]], samples: int, rng: random.Random
) -> float:
    """The hero's share of the pot at showdown (ties split) against a villain uniform over
    ``villain``'s combos that no known card blocks: exact on the river, else ``samples`` seeded
    Monte-Carlo run-outs (standard error <= 0.5 / sqrt(samples))."""
    mine_ids, board_ids = tuple(_ID[c] for c in hero), tuple(_ID[c] for c in board)
    dead = set(mine_ids) | set(board_ids)
    combos = [(_ID[a], _ID[b]) for a, b in villain]
    live = [v for v in combos if v[0] not in dead and v[1] not in dead]
    if not live:
        raise ValueError("the hero's cards and the board block every combo of the villain's range")
    missing = 5 - len(board_ids)
    if missing == 0:
        mine = _strength(mine_ids + board_ids)
        won = 0.0
        for v in live:
            theirs = _strength(v + board_ids)
            won += 1.0 if mine > theirs else 0.5 if mine == theirs else 0.0
        return won / len(live)
    deck = [i for i in range(len(DECK)) if i not in dead]
    won = 0.0
    for _ in range(samples):
        v = live[rng.randrange(len(live))]
        # Two spare cards, so the run-out can skip the villain's without a second draw.
        runout = tuple([c for c in rng.sample(deck, missing + 2) if c not in v][:missing])
        full = board_ids + runout
        mine, theirs = _strength(mine_ids + full), _strength(v + full)
        won += 1.0 if mine > theirs else 0.5 if mine == theirs else 0.0
    return won / samples


# --------------------------------------------------------------------------- spots


def _bet_to(state: State, chips: int | None) -> None:
    """Bet or raise to ``chips`` (None: all-in), clamped to what is legal (a short stack goes all-in)."""
    low = state.min_completion_betting_or_raising_to_amount
    high = state.max_completion_betting_or_raising_to_amount
    assert low is not None and high is not None
    state.complete_bet_or_raise_to(high if chips is None else max(low, min(high, chips)))


def deal(
    hero: str, board: str, stack: int, *, open_to: int = 6, earlier: Sequence[float | None] | None = None,
    villain: str | None = None,
) -> State:
    """A heads-up pokerkit State, blinds 1/2, both players ``stack`` chips, played up to the villain's
    bet on the street ``board`` shows (no board: before the flop). Before the flop the button (the
    villain) acts first, and `villain_bets` is his open; after it the button (the hero) opened to
    ``open_to`` and the big blind (the villain) called, and ``earlier`` says, for each street before
    the spot's, whether the villain bet that fraction of the pot and was called (or None: checked
    through; ``earlier=None``: every one checked through). ``villain``: his cards in the State (any unused two by default; the value model
    ignores them: it uses his range)."""
    hero_cards, board_cards = parse_cards(hero), parse_cards(board)
    if len(hero_cards) != 2 or len(board_cards) not in (0, 3, 4, 5):
        raise ValueError(f"need two hole cards and a board of 0, 3, 4 or 5 cards, got {hero!r} / {board!r}")
    used = set(hero_cards) | set(board_cards)
    villain_cards = parse_cards(villain) if villain else tuple(c for c in DECK if c not in used)[:2]
    street = {0: 0, 3: 1, 4: 2, 5: 3}[len(board_cards)]
    earlier = [None] * max(0, street - 1) if earlier is None else list(earlier)
    if street and len(earlier) != street - 1:
        raise ValueError(f"earlier needs one entry per street before the {STREETS[street]}, got {earlier!r}")
    state = NoLimitTexasHoldem.create_state(
        _AUTOMATIONS, True, 0, BLINDS, BLINDS[1], (stack, stack), 2, mode=Mode.CASH_GAME
    )
    hero_seat = _BB if street == 0 else _BUTTON
    for seat in (0, 1):
        state.deal_hole("".join(map(repr, hero_cards if seat == hero_seat else villain_cards)))
    if street == 0:
        return state
    _bet_to(state, open_to)
    state.check_or_call()
    for i in range(1, street + 1):
        state.burn_card("??")  # an unknown card: see _AUTOMATIONS
        state.deal_board("".join(map(repr, board_cards[:3] if i == 1 else board_cards[i + 1:i + 2])))
        if i == street:
            break
        fraction = earlier[i - 1]
        if fraction is None:
            state.check_or_call()
        else:
            _bet_to(state, max(BLINDS[1], round(state.total_pot_amount * fraction)))
        state.check_or_call()
    return state


def villain_bets(state: State, chips: int | None) -> None:
    """The villain bets (raises, before the flop) to ``chips``, None meaning all-in; the hero is then to act."""
    _bet_to(state, chips)
    if state.actor_index is None or state.street_index is None:
        raise ValueError("after the villain's bet no one is to act")


def _outcome(state: State, hero: int, action: str) -> tuple[int, int]:
    """(pot after ``action`` and the villain's reply, chips the hero put in), read off a copy of ``state``."""
    after = copy.deepcopy(state)
    before = after.stacks[hero]
    if action == "raise" and after.can_complete_bet_or_raise_to():
        # A pot-size raise: to the villain's bet plus the pot after a call; all-in when that is more.
        _bet_to(after, max(after.bets) + after.total_pot_amount + (after.checking_or_calling_amount or 0))
        after.check_or_call()  # the villain calls with his whole range
    else:  # call; or raise where none is legal: the all-in call
        after.check_or_call()
    # Bets are collected, and any uncalled chips returned, once the street's betting closes.
    return after.total_pot_amount, before - after.stacks[hero]


def value(state: State, range_pct: int, samples: int, rng: random.Random, split: str = "eval", index: int = 0) -> Spot:
    """The Spot of the player to act in ``state``, facing a bet, against the top ``range_pct`` % (module docstring)."""
    hero = state.actor_index
    if hero is None or not state.checking_or_calling_amount:
        raise ValueError("the player to act must be facing a bet")
    hero_cards, board = tuple(state.hole_cards[hero]), tuple(state.get_board_cards(0))
    chips = {a: _outcome(state, hero, a) for a in ("call", "raise")}
    pot, call = state.total_pot_amount, state.checking_or_calling_amount
    assert chips["call"] == (pot + call, call), (chips, pot, call)
    eq = equity(hero_cards, board, range_combos(range_pct), samples, rng)
    evs = {"fold": 0.0, **{a: round(eq * pot_after - put_in, 3) for a, (pot_after, put_in) in chips.items()}}
    return Spot(
        split=split, index=index, street=STREETS[{0: 0, 3: 1, 4: 2, 5: 3}[len(board)]],
        hero=" ".join(map(card_text, hero_cards)), board=" ".join(map(card_text, board)), pot=pot, call=call,
        stack=state.stacks[hero], range_pct=range_pct, equity=round(eq, 4), evs=evs,
    )


def generate_spot(seed: int, split: str, index: int, samples: int = 2000) -> Spot:
    """Spot ``index`` of ``split``: a pure function of its arguments (``samples``: Monte-Carlo
    run-outs of the equity before the river)."""
    rng = random.Random(f"poker:{seed}:{split}:{index}")
    stack = 2 * rng.randint(20, 200)  # 20 to 200 big blinds
    street = STREETS.index(rng.choice(STREETS))
    range_pct = rng.choice(RANGE_PCTS)
    cards = [card_text(c) for c in rng.sample(DECK, 2 + 2 + 5)]  # hero, villain (the State needs some), board
    hero, villain, board = " ".join(cards[:2]), " ".join(cards[2:4]), " ".join(cards[4:4 + (0, 3, 4, 5)[street]])
    bb = BLINDS[1]
    if street == 0:
        state = deal(hero, board, stack, villain=villain)
        bet = None if rng.random() < 0.15 else int(bb * rng.choice((2, 2.5, 3, 4, 5, 7, 10)))
    else:
        open_to = int(bb * rng.choice((2, 2.5, 3, 4)))
        earlier = [rng.choice((0.33, 0.5, 0.75)) if rng.random() < 0.5 else None for _ in range(street - 1)]
        state = deal(hero, board, stack, open_to=open_to, earlier=earlier, villain=villain)
        fraction = rng.choice((0.25, 0.33, 0.5, 0.75, 1.0, 1.5, 2.0))
        bet = None if rng.random() < 0.15 else max(bb, round(state.total_pot_amount * fraction))
    villain_bets(state, bet)
    return value(state, range_pct, samples, rng, split, index)


# --------------------------------------------------------------------------- pools


def _generate(args: tuple[int, str, int, int]) -> Spot:
    return generate_spot(*args)


def write_spots(path: Path, seed: int, train: int, eval_: int, samples: int = 2000, workers: int = 1) -> Path:
    """Generate ``eval_`` then ``train`` spots and write them to ``path`` as JSON Lines."""
    jobs = [(seed, "eval", i, samples) for i in range(eval_)] + [(seed, "train", i, samples) for i in range(train)]
    with path.open("w", encoding="utf-8") as f:
        if workers > 1:
            with ProcessPoolExecutor(workers) as pool:
                _write(f, pool.map(_generate, jobs, chunksize=16))
        else:
            _write(f, map(_generate, jobs))
    return path


def _write(f: TextIO, spots: Iterable[Spot]) -> None:
    for spot in spots:
        f.write(json.dumps(asdict(spot), separators=(",", ":")) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate a pool of poker spots (JSON Lines) for the poker task.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--eval", type=int, default=400)
    parser.add_argument("--samples", type=int, default=2000, help="Monte-Carlo run-outs per equity before the river")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    write_spots(args.out, args.seed, args.train, args.eval, args.samples, args.workers)
    print(f"wrote {args.train + args.eval} spots to {args.out} in {time.perf_counter() - started:.0f} s")


# Equity of each starting-hand class against a random hand: class_equity(name, samples=20000, seed=0)
# (standard error ~0.0035, so near neighbours may be in another order than an exact table's).
PREFLOP_EQUITY: dict[str, float] = {
    "aa": 0.8527, "kk": 0.8272, "qq": 0.7982, "jj": 0.7751, "tt": 0.7501, "99": 0.7207, "88": 0.6917,
    "aks": 0.6688, "77": 0.6676, "aqs": 0.6653, "ako": 0.6539, "ajs": 0.6514, "ats": 0.6478, "kqs": 0.6398,
    "aqo": 0.6383, "ajo": 0.6347, "66": 0.6315, "ato": 0.6291, "kjs": 0.6291, "a9s": 0.6279, "a8s": 0.6206,
    "kts": 0.6157, "a7s": 0.6144, "qjs": 0.6121, "kqo": 0.61, "a9o": 0.6098, "55": 0.6093, "kjo": 0.6038,
    "a5s": 0.603, "a8o": 0.5994, "k9s": 0.5982, "qts": 0.5982, "a6s": 0.5977, "kto": 0.592, "a4s": 0.5913,
    "a7o": 0.5898, "a3s": 0.5844, "k9o": 0.5835, "a6o": 0.5818, "qjo": 0.5812, "q9s": 0.5807, "a5o": 0.5788,
    "k8s": 0.578, "a4o": 0.5742, "44": 0.5739, "qto": 0.5739, "jts": 0.5719, "k7s": 0.5716, "k6s": 0.5715,
    "a2s": 0.5642, "a3o": 0.5587, "q8s": 0.5587, "k5s": 0.5545, "k8o": 0.5544, "q9o": 0.5536, "k3s": 0.5515,
    "j9s": 0.5513, "a2o": 0.5492, "k7o": 0.5479, "jto": 0.5476, "q7s": 0.5439, "k4s": 0.5436, "j8s": 0.543,
    "k6o": 0.5415, "t9s": 0.5377, "k2s": 0.5367, "q6s": 0.5361, "q8o": 0.5344, "j9o": 0.5342, "q5s": 0.5322,
    "33": 0.5306, "k5o": 0.5306, "t8s": 0.528, "j7s": 0.524, "k4o": 0.5236, "q3s": 0.5165, "q7o": 0.5163,
    "j8o": 0.5159, "q4s": 0.5157, "t9o": 0.5152, "k3o": 0.5138, "98s": 0.5091, "k2o": 0.5073, "q6o": 0.5068,
    "j6s": 0.5046, "q5o": 0.5038, "q2s": 0.5029, "t7s": 0.5006, "22": 0.5, "t8o": 0.4958, "97s": 0.4944,
    "j4s": 0.4926, "t6s": 0.4924, "q4o": 0.4919, "j5s": 0.4912, "j7o": 0.4905, "j3s": 0.4824, "j6o": 0.4792,
    "q3o": 0.4785, "98o": 0.4774, "t5s": 0.4762, "87s": 0.4737, "96s": 0.4729, "j2s": 0.4723, "t7o": 0.4714,
    "q2o": 0.4711, "j5o": 0.4709, "86s": 0.4674, "97o": 0.4653, "j4o": 0.4647, "t6o": 0.4629, "t4s": 0.4613,
    "t3s": 0.4553, "95s": 0.454, "j3o": 0.453, "t2s": 0.4506, "j2o": 0.4496, "76s": 0.4492, "87o": 0.4486,
    "t5o": 0.4456, "96o": 0.443, "85s": 0.4427, "94s": 0.4401, "93s": 0.44, "75s": 0.4351, "t4o": 0.4337,
    "86o": 0.4319, "84s": 0.4303, "65s": 0.4293, "95o": 0.4282, "92s": 0.4261, "76o": 0.4259, "t3o": 0.4236,
    "t2o": 0.4188, "64s": 0.4174, "85o": 0.4166, "74s": 0.4155, "83s": 0.4125, "94o": 0.4123, "54s": 0.4097,
    "93o": 0.4057, "82s": 0.4044, "75o": 0.4031, "73s": 0.4013, "84o": 0.4006, "53s": 0.3986, "65o": 0.3977,
    "63s": 0.3907, "92o": 0.3884, "72s": 0.3866, "52s": 0.3846, "43s": 0.3823, "74o": 0.3819, "54o": 0.3808,
    "83o": 0.3764, "62s": 0.3754, "64o": 0.374, "82o": 0.3702, "42s": 0.3701, "73o": 0.3696, "53o": 0.3634,
    "63o": 0.3613, "32s": 0.3599, "43o": 0.3554, "52o": 0.3438, "72o": 0.3424, "62o": 0.341, "42o": 0.3266,
    "32o": 0.3251,
}


if __name__ == "__main__":
    main()

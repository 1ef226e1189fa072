"""Poker task: seeded spots built with pokerkit, held-out eval spots, EV rewards on hand-checked spots,
malformed answers, and a reward fast enough for the learner to score every completion."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from echo2swarm.tasks import PokerTask, SupervisedTask, Task, get_task
from echo2swarm.tasks.poker import ACTIONS, Spot, parse_action, read_spots, spots_path
from echo2swarm.tasks.poker_spots import (
    PREFLOP_EQUITY,
    class_equity,
    deal,
    generate_spot,
    range_combos,
    value,
    villain_bets,
)


def _spot(hero: str, board: str, bet: int | None, range_pct: int, *, stack: int = 200, index: int = 0) -> Spot:
    state = deal(hero, board, stack)
    villain_bets(state, bet)
    return value(state, range_pct, samples=4000, rng=random.Random(f"test:{index}"), split="eval", index=index)


def _pool(path: Path, spots: list[Spot]) -> Path:
    path.write_text("".join(json.dumps(asdict(s)) + "\n" for s in spots), encoding="utf-8")
    return path


def test_the_nuts_facing_a_bet_raises() -> None:
    spot = _spot("jh th", "ah kh qh 2c 3d", 20, 20)  # a royal flush on the river
    assert spot.street == "river" and spot.equity == 1.0
    assert (spot.pot, spot.call, spot.stack) == (32, 20, 194)  # 6 + 6 before the flop, then the bet of 20
    # call: win the 52 chips after calling, for 20; raise: pot-size, to 20 + 52 = 72, called: 156 for 72.
    assert spot.evs == {"fold": 0.0, "call": 32.0, "raise": 84.0}
    rewards = spot.rewards()
    assert rewards["raise"] == 1.0 > rewards["call"] > rewards["fold"] == 0.0
    assert spot.best_action() == "raise"


def test_seven_deuce_facing_a_big_all_in_folds() -> None:
    spot = _spot("7c 2d", "", None, 10)  # the villain shoves 200 with the top 10 % of hands
    assert spot.street == "preflop" and spot.call == spot.stack == 198
    assert 0.2 < spot.equity < 0.3
    # The shove covers the stack: no raise is legal, so "raise" is the all-in call.
    assert spot.evs["call"] == spot.evs["raise"] < -80
    assert spot.rewards() == {"fold": 1.0, "call": 0.0, "raise": 0.0}
    assert spot.best_action() == "fold"


def test_a_draw_getting_a_good_price_calls() -> None:
    # The nut flush draw with an overcard against the top 20 %, facing a bet of 3 into 12: a price
    # of 3 / 18 for ~48 % equity, just short of the half that would make raising better.
    spot = _spot("as 5s", "ks 9s 2h", 3, 20)
    assert (spot.pot, spot.call) == (15, 3)
    assert spot.call / (spot.pot + spot.call) < spot.equity < 0.5
    assert spot.best_action() == "call"
    rewards = spot.rewards()
    assert rewards["call"] == 1.0 > rewards["raise"] > rewards["fold"] == 0.0


def test_rewards_follow_the_ev_model_on_every_pooled_spot() -> None:
    for spot in read_spots(spots_path())[:400]:
        eq, pot, call = spot.equity, spot.pot, spot.call
        assert spot.evs["fold"] == 0.0
        assert spot.evs["call"] == pytest.approx(eq * (pot + call) - call, abs=1e-4 * (pot + call) + 1e-3)
        # call beats fold exactly when the equity beats the price; raise beats call when it is over 1/2
        # (or is the same all-in call, when the bet covers the stack).
        assert (spot.evs["call"] > 0) == (eq > call / (pot + call)) or abs(spot.evs["call"]) < 1e-2
        if spot.call < spot.stack:
            assert (spot.evs["raise"] > spot.evs["call"]) == (eq > 0.5) or abs(eq - 0.5) < 1e-3
        else:
            assert spot.evs["raise"] == spot.evs["call"]
        rewards = spot.rewards()
        assert max(rewards.values()) == 1.0 and min(rewards.values()) in (0.0, 1.0)
        assert rewards[spot.best_action()] == 1.0


def test_generator_is_deterministic_and_seeded() -> None:
    a = generate_spot(0, "train", 5, samples=200)
    assert generate_spot(0, "train", 5, samples=200) == a
    assert generate_spot(1, "train", 5, samples=200) != a
    assert generate_spot(0, "eval", 5, samples=200) != a
    # The shipped pool is what the generator makes: spot by spot, at the pool's sample count.
    stored = {(s.split, s.index): s for s in read_spots(spots_path())}
    for key in (("eval", 0), ("eval", 399), ("train", 0), ("train", 2999)):
        assert generate_spot(0, *key) == stored[key], key


def test_preflop_table_and_ranges() -> None:
    assert class_equity("aa", samples=20000, seed=0) == pytest.approx(PREFLOP_EQUITY["aa"], abs=5e-5)
    assert len(PREFLOP_EQUITY) == 169
    order = sorted(PREFLOP_EQUITY, key=lambda n: -PREFLOP_EQUITY[n])
    assert order[:3] == ["aa", "kk", "qq"] and set(order[-3:]) <= {"32o", "42o", "62o", "72o", "52o", "43o"}
    assert len(range_combos(100)) == 1326 and len(set(range_combos(100))) == 1326
    top5 = range_combos(5)
    assert 0.05 * 1326 <= len(top5) < 0.07 * 1326 and len(range_combos(10)) > len(top5)
    for bad in (0, 101, 5.0, True):
        with pytest.raises(ValueError, match="range_pct"):
            range_combos(bad)  # type: ignore[arg-type]


def test_task_prompts_answers_and_held_out_split() -> None:
    task = get_task("poker", seed=3)
    assert isinstance(task, PokerTask) and isinstance(task, Task) and isinstance(task, SupervisedTask)
    n_train = len(read_spots(spots_path())) - task.eval_size()
    assert (task.eval_size(), n_train) == (400, 3000)
    eval_prompts = [task.prompt(i, "eval").text for i in range(task.eval_size())]
    train_prompts = [task.prompt(i).text for i in range(n_train)]
    # Eval spots come from seeds of their own and never appear among train spots.
    assert len(set(eval_prompts)) == 400 and set(eval_prompts).isdisjoint(train_prompts)
    # Train: every train spot once per pass, reshuffled (by seed) from pass to pass.
    assert len(set(train_prompts)) == n_train
    assert sorted(task.prompt(i).text for i in range(n_train, 2 * n_train)) == sorted(train_prompts)
    other = PokerTask(seed=4)
    assert [task.prompt(i).text for i in range(50)] != [other.prompt(i).text for i in range(50)]
    assert [task.prompt(i, "eval") for i in range(400)] == [other.prompt(i, "eval") for i in range(400)]
    # Cards high rank first, the price a call needs (6 / 16 = 38 %), the stated range.
    assert task.prompt(0, "eval").text == ("hand td 7h board none pot 10 call 6 price 38 stack 198 villain top 15 "
                                           "action:")
    assert task.spot(1, "eval").board == "3s ks kd js 7d" and "board kd ks js 7d 3s " in task.prompt(1, "eval").text
    # Prompts fit the tiny model (128 positions, answer and EOS included); ids carry no answer.
    p = task.prompt(7)
    assert p.prompt_id == "train:7" and p.text.endswith(" action:") and max(map(len, train_prompts)) <= 100
    assert task.answer(7) in ACTIONS and task.reward(p.prompt_id, task.answer(7), finished=True) == 1.0


def test_reward_reads_the_action_and_zeroes_the_malformed(tmp_path: Path) -> None:
    nuts, junk = _spot("jh th", "ah kh qh 2c 3d", 20, 20, index=0), _spot("7c 2d", "", None, 10, index=1)
    train = _spot("as 5s", "ks 9s 2h", 3, 20, index=0)
    train = Spot(**{**asdict(train), "split": "train"})
    task = PokerTask(spots=_pool(tmp_path / "pool.jsonl", [nuts, junk, train]))
    assert task.eval_size() == 2
    for completion in ("raise", " Raise.", "RAISE\n", "raise.", "r", " R."):
        assert task.reward("eval:0", completion, finished=True) == 1.0
    assert task.reward("eval:0", "call", finished=True) == pytest.approx(32 / 84)
    assert task.reward("eval:0", "fold", finished=True) == 0.0
    assert task.reward("eval:1", "fold", finished=True) == 1.0
    for malformed in ("", " ", "ra", "raises", "raise raise", "call or raise", "check", "bet", "all-in", "fold!",
                      "cald", "fc", "x", "\x00", "fold" * 40, "<eos>"):
        assert parse_action(malformed) is None
        assert task.reward("eval:1", malformed, finished=True) == 0.0
    assert task.reward("eval:1", "fold", finished=False) == 0.0  # cut at the token limit
    assert PokerTask(spots=task.path, require_finished=False).reward("eval:1", "fold", finished=False) == 1.0
    # answers = "letters": the warm-up teaches one letter per action; words still count.
    letters = PokerTask(spots=task.path, answers="letters")
    assert [letters.answer(i, "eval") for i in range(2)] == ["r", "f"] and letters.answer(0) == "c"
    assert [task.answer(i, "eval") for i in range(2)] == ["raise", "fold"]
    assert letters.reward("eval:1", "f", finished=True) == letters.reward("eval:1", "fold", finished=True) == 1.0
    for bad_id in ("eval:2", "train", "x:0", "eval:-1"):
        with pytest.raises(ValueError):
            task.reward(bad_id, "fold", finished=True)


def test_reward_takes_microseconds() -> None:
    task = PokerTask()
    completions = ["fold", "call", "raise", " Call.", "garbage that is not an action", ""]
    ids = [task.prompt(i).prompt_id for i in range(600)] + [task.prompt(i, "eval").prompt_id for i in range(400)]
    started = time.perf_counter()
    n = 0
    for pid in ids:
        for completion in completions:
            task.reward(pid, completion, finished=True)
            n += 1
    per_call = (time.perf_counter() - started) / n
    assert per_call < 2e-4, f"{per_call * 1e6:.0f} us per reward"  # ~5 us here; the bound allows a busy machine


def test_bad_pools_name_the_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="spots = .*missing.jsonl.* is not a file"):
        PokerTask(spots=tmp_path / "missing.jsonl")
    good = asdict(_spot("jh th", "ah kh qh 2c 3d", 20, 20))
    cases = {
        "repeat.jsonl": {**good, "board": "jh kh qh 2c 3d"},
        "street.jsonl": {**good, "street": "flop"},
        "evs.jsonl": {**good, "evs": {"fold": 0.0, "call": 1.0}},
        "extra.jsonl": {**good, "villain": "as ad"},
        "equity.jsonl": {**good, "equity": 1.5},
        "cards.jsonl": {**good, "hero": "Jh Th"},
    }
    for name, row in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=rf"{name}, line 2: not a poker spot"):
            PokerTask(spots=path)
    with pytest.raises(ValueError, match="needs train and eval spots; it has 0 train and 1 eval"):
        PokerTask(spots=_pool(tmp_path / "eval_only.jsonl", [Spot(**good)]))
    twice = _pool(tmp_path / "twice.jsonl", [Spot(**good), Spot(**good), Spot(**{**good, "split": "train"})])
    with pytest.raises(ValueError, match="two spots share a split and index"):
        PokerTask(spots=twice)
    for bad in ({"seed": "0"}, {"require_finished": 1}, {"answers": "emoji"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PokerTask(**bad)  # type: ignore[arg-type]

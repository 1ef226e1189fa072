"""µ, the rollouts per engine second a peer advertises: calibration, the cache, the EWMA over leases."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from echo2swarm.config.loading import load_config
from echo2swarm.rollout.engines.runner import Batch
from echo2swarm.rollout.throughput import Throughput

pytestmark = pytest.mark.timeout(30)


class TimedEngine:
    """Answers every batch as if it took `busy_s` engine seconds; records what it was asked."""

    def __init__(self, busy_s: float):
        self.busy_s = busy_s
        self.calls: list[tuple[list[str], Any]] = []

    def submit_generate(self, prompts: list[str], params: Any, version: int | None) -> Future[Batch]:
        self.calls.append((prompts, params))
        done: Future[Batch] = Future()
        done.set_result(Batch(groups=[[] for _ in prompts], version=version, busy_s=self.busy_s))
        return done


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text('{"hidden_size": 128}')
    return path


def throughput(tmp_path: Path, **overrides: object) -> Throughput:
    config = load_config("rollout", None, environ={}, overrides={"state_dir": str(tmp_path / "state"), **overrides})
    return Throughput(config, tmp_path / "throughput.json")


def test_calibrates_once_then_reads_the_cache(tmp_path: Path, model_dir: Path) -> None:
    first = throughput(tmp_path)
    engine = TimedEngine(busy_s=0.5)
    first.calibrate(engine, model_dir)
    # The default calibration batch: 4 prompts x 8 completions in 0.5 s.
    assert len(engine.calls) == 1 and engine.calls[0][1].n == 8
    assert first.rollouts_per_s == pytest.approx(64.0)

    again = throughput(tmp_path)
    unused = TimedEngine(busy_s=99.0)
    again.calibrate(unused, model_dir)
    assert unused.calls == [] and again.rollouts_per_s == pytest.approx(64.0)

    # Another architecture is another key: measured again.
    (model_dir / "config.json").write_text('{"hidden_size": 256}')
    other = throughput(tmp_path)
    other.calibrate(TimedEngine(busy_s=1.0), model_dir)
    assert other.rollouts_per_s == pytest.approx(32.0)


def test_leases_move_an_ewma_and_new_sampling_starts_afresh(tmp_path: Path, model_dir: Path) -> None:
    mu = throughput(tmp_path)  # ewma_alpha 0.2
    mu.calibrate(TimedEngine(busy_s=1.0), model_dir)
    mu.observe(n=8, max_new_tokens=8, rollouts=64, busy_s=1.0)  # the calibration's settings: averaged
    assert mu.rollouts_per_s == pytest.approx(0.8 * 32.0 + 0.2 * 64.0)
    mu.observe(n=4, max_new_tokens=16, rollouts=32, busy_s=2.0)  # other settings: the old value says nothing
    assert mu.rollouts_per_s == pytest.approx(16.0)
    saved = json.loads((tmp_path / "throughput.json").read_text())
    assert saved["last_sampling"] == [4, 16]
    assert sorted(saved["mu"].values()) == [16.0, 32.0]

    # A restart calibrates from the settings the learner used last, without touching the engine.
    restarted = throughput(tmp_path)
    restarted.calibrate(engine := TimedEngine(busy_s=5.0), model_dir)
    assert engine.calls == [] and restarted.rollouts_per_s == pytest.approx(16.0)


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"mu": [1, 2], "last_sampling": "x"}',
                                  '{"mu": {"k": -1}, "last_sampling": [8, 8]}'])
def test_a_damaged_cache_is_measured_over(tmp_path: Path, model_dir: Path, text: str) -> None:
    (tmp_path / "throughput.json").write_text(text)
    mu = throughput(tmp_path)
    mu.calibrate(TimedEngine(busy_s=0.25), model_dir)
    assert mu.rollouts_per_s == pytest.approx(128.0)
    assert json.loads((tmp_path / "throughput.json").read_text())["last_sampling"] == [8, 8]


def test_no_calibration_when_turned_off(tmp_path: Path, model_dir: Path) -> None:
    mu = throughput(tmp_path, **{"worker.calibrate": False})
    engine = TimedEngine(busy_s=1.0)
    mu.calibrate(engine, model_dir)
    assert engine.calls == [] and mu.rollouts_per_s is None
    mu.observe(n=2, max_new_tokens=4, rollouts=10, busy_s=0.5)
    assert mu.rollouts_per_s == pytest.approx(20.0)

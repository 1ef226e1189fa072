"""The learner's experiment trackers (learner/metrics.py, [metrics] in config/metrics.py).

Each sink's output is read back with the library's own reader: TensorBoard's EventAccumulator,
and W&B's `wandb leet inspect --json` (wandb-core's reader of the run's .wandb transaction log).
W&B runs offline here, with every directory it writes in tmp_path and no API key, so nothing
reaches the network; each W&B test ends the wandb-core service it started.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from echo2swarm.config.loading import ConfigError, load_config
from echo2swarm.config.metrics import MetricsConfig
from echo2swarm.train.group import Group
from echo2swarm.learner.metrics import MetricsLog, read_metrics, sample_rows, scalars

STEPS = 6


def _groups() -> list[Group]:
    """Two prompts with two completions each; token ids decode to their own text below."""
    return [
        Group("p-a", 3, [10, 11], [[1, 2], [3]], [[0.0, 0.0], [0.0]], [1.0, 0.0], ["stop", "stop"], peer_id="peer-a"),
        Group("p-b", 4, [12], [[4], [5, 6]], [[0.0], [0.0, 0.0]], [0.5, 0.25], ["stop", "length"], peer_id="peer-b"),
    ]


def _decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _record(step: int) -> dict[str, Any]:
    return {"step": step, "version": step, "reward_mean": step / 10, "loss": 1.0 / step, "t_bcast_s": None,
            "refused": {"stale": step}, "staleness": [0, step], "peer": "text is not a scalar"}


def _write_steps(log: MetricsLog, steps: int = STEPS) -> None:
    for step in range(1, steps + 1):
        log.write(_record(step), groups=_groups())


def _children(name: str) -> list[int]:
    """Pids of this process's children whose command is `name` (wandb-core)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid_comm, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        pid, comm = pid_comm.split(" (", 1)
        state, ppid = rest.split()[:2]
        if int(ppid) == os.getpid() and comm == name and state != "Z":
            pids.append(int(pid))
    return pids


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B with no key, no network and every directory it writes in tmp_path; its service ended after."""
    wandb = pytest.importorskip("wandb", reason="the `wandb` extra (make install installs it)")
    home = tmp_path / "wandb-home"
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("NETRC", str(home / "netrc"))  # no stored key either
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # were anything to try the network: a closed port
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    try:
        yield tmp_path
    finally:
        try:
            wandb.teardown()  # ends wandb-core; raises if a test killed it, and still resets wandb
        except Exception:
            pass
        assert _children("wandb-core") == [], "wandb-core still running after teardown"


def _inspect(run_dir: Path) -> list[dict[str, Any]]:
    """The run's records as W&B's own reader prints them, one JSON object a line."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def _offline_run_dir(wandb_dir: Path) -> Path:
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


# --- TensorBoard --------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_tensorboard_scalars_and_samples_read_back_with_event_accumulator(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    log = MetricsLog(tmp_path, MetricsConfig(sinks=["tensorboard"], samples_every=3, samples_count=3), decode=_decode,
                     hparams={"train": {"lr": 0.01}})
    assert log.sinks == ["jsonl", "tensorboard"]
    _write_steps(log)
    log.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    reward = events.Scalars("reward_mean")
    assert [e.step for e in reward] == list(range(1, STEPS + 1))
    assert [e.value for e in reward] == pytest.approx([s / 10 for s in range(1, STEPS + 1)])
    assert [e.value for e in events.Scalars("refused/stale")] == list(range(1, STEPS + 1))
    assert [e.value for e in events.Scalars("staleness/max")] == list(range(1, STEPS + 1))
    assert "peer" not in events.Tags()["scalars"] and "t_bcast_s" not in events.Tags()["scalars"]

    texts = events.Tensors("samples/text_summary")
    assert [e.step for e in texts] == [3, 6]
    table = tensor_util.make_ndarray(texts[0].tensor_proto).item().decode()
    # Round-robin over the groups: the first completion of each, then the second of the first.
    assert "| 3 | 3 | peer-a | p-a | t10 t11 | t1 t2 | 1 |" in table
    assert "| 3 | 4 | peer-b | p-b | t12 | t4 | 0.5 |" in table
    assert "| 3 | 3 | peer-a | p-a | t10 t11 | t3 | 0 |" in table
    config = tensor_util.make_ndarray(events.Tensors("config/text_summary")[0].tensor_proto).item().decode()
    assert '"lr": 0.01' in config

    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, STEPS + 1))
    samples = read_metrics(tmp_path / "samples.jsonl")
    assert [(s["step"], s["prompt_id"], s["completion"], s["reward"]) for s in samples] == [
        (3, "p-a", "t1 t2", 1.0), (3, "p-b", "t4", 0.5), (3, "p-a", "t3", 0.0),
        (6, "p-a", "t1 t2", 1.0), (6, "p-b", "t4", 0.5), (6, "p-a", "t3", 0.0),
    ]


def test_tensorboard_is_written_only_when_configured(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, decode=_decode)  # default: jsonl only
    _write_steps(log)
    log.close()
    assert log.sinks == ["jsonl"]
    assert not (tmp_path / "tensorboard").exists()
    # samples_every defaults to 10: six steps log no samples
    assert not (tmp_path / "samples.jsonl").exists()


def test_a_tensorboard_sink_that_cannot_start_warns_once_and_jsonl_keeps_every_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the event directory should be")
    with caplog.at_level(logging.WARNING, logger="echo2swarm.learner.metrics"):
        log = MetricsLog(tmp_path / "run", MetricsConfig(sinks=["tensorboard"], tensorboard_dir=blocker))
        _write_steps(log)
        log.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "metrics sink tensorboard failed to start" in warnings[0], warnings
    assert "metrics.jsonl keeps every step" in warnings[0]
    assert log.sinks == ["jsonl"] and log.sink_errors == {"tensorboard": 1}
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, STEPS + 1))


# --- Weights & Biases ---------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_wandb_offline_run_reads_back_with_wandbs_own_reader(wandb_offline: Path) -> None:
    run_dir = wandb_offline / "run"
    config = MetricsConfig(sinks=["jsonl", "wandb"], wandb_mode="offline", wandb_project="e2s-test",
                           wandb_run_name="learner-1", wandb_tags=["unit", "arith"], samples_every=3, samples_count=2)
    log = MetricsLog(run_dir, config, decode=_decode, hparams={"train": {"lr": 0.01}})
    assert log.sinks == ["jsonl", "wandb"], log.failed
    _write_steps(log)
    log.close()

    records = _inspect(_offline_run_dir(run_dir))  # wandb_dir defaults to the run dir
    run = next(r["run"] for r in records if r["type"] == "run")
    assert (run["project"], run["display_name"], run["tags"]) == ("e2s-test", "learner-1", ["unit", "arith"])
    assert run["config"]["update"]["train"] == {"lr": 0.01}  # the resolved learner config, for reproducing the run
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [int(h["step"]["num"]) for h in history] == list(range(1, STEPS + 1))
    assert [h["item"]["reward_mean"] for h in history] == pytest.approx([s / 10 for s in range(1, STEPS + 1)])
    assert [h["item"]["refused/stale"] for h in history] == list(range(1, STEPS + 1))
    assert all("peer" not in h["item"] and "t_bcast_s" not in h["item"] for h in history)
    tables = [(int(h["step"]["num"]), h["item"]) for h in history if "samples._type" in h["item"]]
    assert [step for step, _ in tables] == [3, 6]
    assert all(item["samples._type"] == "table-file" and item["samples.nrows"] == 2 for _, item in tables)
    table = json.loads((_offline_run_dir(run_dir) / "files" / tables[0][1]["samples.path"]).read_text())
    assert table["columns"] == ["step", "version", "peer", "prompt_id", "prompt", "completion", "reward"]
    assert table["data"] == [[3, 3, "peer-a", "p-a", "t10 t11", "t1 t2", 1.0], [3, 4, "peer-b", "p-b", "t12", "t4", 0.5]]


@pytest.mark.timeout(90)
def test_a_wandb_sink_whose_service_dies_warns_once_and_jsonl_keeps_every_step(
        wandb_offline: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = wandb_offline / "run"
    log = MetricsLog(run_dir, MetricsConfig(sinks=["wandb", "tensorboard"], wandb_mode="offline"))
    log.write(_record(1))
    (core,) = _children("wandb-core")
    os.kill(core, signal.SIGKILL)  # W&B's service process: every later call on the run raises
    os.waitpid(core, 0)
    with caplog.at_level(logging.WARNING, logger="echo2swarm.learner.metrics"):
        for step in range(2, STEPS + 1):
            log.write(_record(step))
        assert log.sinks == ["jsonl", "tensorboard"] and log.sink_errors == {"wandb": 1}
        log.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "metrics sink wandb failed to write" in warnings[0], warnings
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))


@pytest.mark.timeout(60)
def test_wandb_online_without_an_api_key_warns_with_what_to_do_and_training_goes_on(
        wandb_offline: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="echo2swarm.learner.metrics"):
        log = MetricsLog(wandb_offline / "run", MetricsConfig(sinks=["wandb"], wandb_mode="online"))
        _write_steps(log)
        log.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "metrics sink wandb failed to start" in warnings[0], warnings
    assert 'wandb_mode = "offline"' in warnings[0]
    assert log.sinks == ["jsonl"]
    assert len(read_metrics(wandb_offline / "run" / "metrics.jsonl")) == STEPS


# --- pieces -------------------------------------------------------------------------------------

def test_scalars_flatten_counters_and_summarise_lists() -> None:
    assert scalars(_record(2)) == {"version": 2, "reward_mean": 0.2, "loss": 0.5, "refused/stale": 2,
                                   "staleness/mean": 1.0, "staleness/max": 2}


def test_sample_rows_stop_at_the_completions_there_are() -> None:
    rows = sample_rows(7, _groups(), 10, _decode)
    assert [(r["prompt_id"], r["completion"]) for r in rows] == [
        ("p-a", "t1 t2"), ("p-b", "t4"), ("p-a", "t3"), ("p-b", "t5 t6")]
    assert {r["step"] for r in rows} == {7}


def test_samples_every_zero_logs_no_samples(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, MetricsConfig(samples_every=0), decode=_decode)
    _write_steps(log)
    log.close()
    assert not (tmp_path / "samples.jsonl").exists()


# --- config -------------------------------------------------------------------------------------

def _learner(**overrides: object):
    return load_config("learner", None, environ={}, overrides={"publish.model": "m", "publish.policy_key": "k", **overrides})


@pytest.mark.parametrize(("field", "value", "says"), [
    ("metrics.sinks", ["jsonl", "mlflow"], "'jsonl', 'tensorboard' or 'wandb'"),
    ("metrics.sinks", ["wandb", "wandb"], "'wandb' is listed twice"),
    ("metrics.wandb_mode", "on", "'online', 'offline' or 'disabled'"),
    ("metrics.wandb_project", "team/project", "without /"),
    ("metrics.wandb_tags", ["x" * 65], "1-64 characters"),
    ("metrics.samples_every", -1, "greater than or equal to 0"),
    ("metrics.samples_count", 0, "greater than or equal to 1"),
    ("metrics.wandb_init_timeout_s", 0, "greater than 0"),
    ("metrics.bogus", 1, "unknown setting"),
])
def test_config_errors_name_the_field(field: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        _learner(**{field: value})
    assert field in str(info.value) and says in str(info.value)


def test_jsonl_is_always_a_sink_and_env_lists_split() -> None:
    assert _learner().metrics.sinks == ["jsonl"]
    assert _learner(**{"metrics.sinks": ["wandb"]}).metrics.sinks == ["jsonl", "wandb"]
    config = load_config("learner", None, environ={"ECHO2SWARM_METRICS__SINKS": "tensorboard,jsonl",
                                                   "ECHO2SWARM_METRICS__WANDB_TAGS": "a b"},
                         overrides={"publish.model": "m", "publish.policy_key": "k"})
    assert config.metrics.sinks == ["tensorboard", "jsonl"] and config.metrics.wandb_tags == ["a", "b"]

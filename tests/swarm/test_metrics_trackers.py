"""A real learner daemon logging to TensorBoard and an offline W&B run ([metrics]), read back with
each library's own reader. The daemon leaves with os._exit, so only a learner that finishes its
sinks itself leaves a W&B run with its records (unit tests cover the sinks: tests/unit/learner/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.swarm import LocalSwarm, learner_toml, read_metrics

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]
STEPS = 6


def test_learner_writes_tensorboard_wandb_and_samples(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
) -> None:
    pytest.importorskip("wandb", reason="the `wandb` extra (make install installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=STEPS, sections={"metrics": {
        "sinks": ["jsonl", "tensorboard", "wandb"], "wandb_mode": "offline", "wandb_project": "swarm-test",
        "wandb_tags": ["arith"], "samples_every": 2, "samples_count": 3}})
    home = tmp_path / "wandb-home"  # W&B writes nothing outside tmp_path and reaches no server
    env = {"WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"), "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
           "NETRC": str(home / "netrc"), "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "",
           "ECHO2SWARM_ACTIVATION__ENABLED": "false"}
    local_swarm.bootstrap()
    learner = local_swarm.start("learner", "--config", str(config), env=env)
    peer = local_swarm.rollout("rollout-1", trust=Path(f"{policy_key}.pub"), env={"ECHO2SWARM_ENGINE__THREADS": "1"})
    for daemon in (learner, peer):
        local_swarm.ready(daemon)
    assert learner.proc is not None
    learner.proc.wait(240)  # the learner exits by itself after its last step
    assert learner.proc.returncode == 0, learner.log_tail()
    run = learner.state_dir / "run"
    assert "metrics sink" not in learner.log_tail(), "no sink failed"

    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    samples = read_metrics(run / "samples.jsonl")
    assert [s["step"] for s in samples] == [2, 2, 2, 4, 4, 4, 6, 6, 6]
    assert all(s["prompt"].endswith("=") and s["reward"] in (0.0, 1.0) for s in samples), samples  # arith: "a+b="

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    reward = events.Scalars("reward_mean")
    assert [e.step for e in reward] == list(range(1, STEPS + 1))
    assert [e.value for e in reward] == pytest.approx([r["reward_mean"] for r in records])
    assert [e.step for e in events.Tensors("samples/text_summary")] == [2, 4, 6]

    (wandb_run,) = (run / "wandb").glob("offline-run-*")  # wandb_dir defaults to the run dir
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_run)],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=True)
    logged = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    history = [r["history"] for r in logged if r["type"] == "history"]
    assert [int(h["step"]["num"]) for h in history] == list(range(1, STEPS + 1))
    assert [h["item"]["reward_mean"] for h in history] == pytest.approx([r["reward_mean"] for r in records])
    assert [int(h["step"]["num"]) for h in history if "samples._type" in h["item"]] == [2, 4, 6]
    run_record = next(r["run"] for r in logged if r["type"] == "run")
    assert run_record["project"] == "swarm-test" and run_record["tags"] == ["arith"]
    assert run_record["config"]["update"]["train"]["steps"] == STEPS  # the resolved learner config
    assert [r["exit"].get("exit_code", 0) for r in logged if r["type"] == "exit"] == [0]  # the run was finished

"""The rollout engine in a process of its own, on a real swarm: a killed engine process is replaced
and the peer keeps delivering; a killed daemon leaves no engine process behind; a refit budget
defers weight loads without letting a lease run on weights it does not accept."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from helpers.swarm import LocalSwarm, http_json, learner_toml, wait_until

from echo2swarm.runtime.processes import child_pids, pid_alive

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def _stats(daemon: Any) -> dict[str, Any]:
    return http_json(daemon.info["chunk_url"] + "/v1/info")["stats"]


@pytest.mark.spawn  # the engine as users' daemons start it: a child of the daemon, not of the suite's launcher
def test_a_killed_engine_process_is_replaced_and_a_killed_daemon_leaves_none(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path,
) -> None:
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=100000, staleness=2)
    local_swarm.bootstrap()
    learner = local_swarm.start("learner", "--config", str(config))
    peer = local_swarm.rollout("rollout", trust=Path(f"{policy_key}.pub"), env={"ECHO2SWARM_ENGINE__THREADS": "1"})
    local_swarm.ready(learner)
    local_swarm.ready(peer)

    stats = wait_until(lambda: (s := _stats(peer)).get("worker", {}).get("rollouts", 0) >= 32 and s, 120,
                       interval=0.2, what="the peer to deliver rollouts")
    first = stats["engine_pid"]
    assert first in child_pids(peer.pid), "the engine runs in a child process of the daemon"
    assert stats["engine_restarts"] == 0

    os.kill(first, signal.SIGKILL)
    before = stats["worker"]["rollouts"]
    try:
        stats = wait_until(lambda: (s := _stats(peer)).get("engine_restarts", 0) >= 1
                           and s["worker"].get("rollouts", 0) >= before + 64 and s, 120, interval=0.2,
                           what="a new engine process and 64 more rollouts")
    except TimeoutError as e:  # say where it stopped: the engine, the leases or the learner
        raise AssertionError(f"{e}\npeer: {_stats(peer)}\nlearner: {_stats(learner)}") from e
    second = stats["engine_pid"]
    assert second != first and not pid_alive(first) and pid_alive(second)
    accepted = stats["worker"].get("groups_accepted", 0)
    wait_until(lambda: _stats(peer)["worker"].get("groups_accepted", 0) > accepted, 60, interval=0.2,
               what="the learner to accept groups from the new engine")

    os.kill(peer.pid, signal.SIGKILL)  # no cleanup code of the daemon runs
    wait_until(lambda: not pid_alive(second), 15, interval=0.05, what="the orphaned engine process to exit")
    for pid in child_pids(peer.pid):
        assert not pid_alive(pid)


def test_a_refit_budget_defers_loads_but_never_serves_a_lease_on_weights_it_refuses(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path,
) -> None:
    staleness = 3
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=100000, staleness=staleness)
    local_swarm.bootstrap()
    learner = local_swarm.start("learner", "--config", str(config))
    # A budget so small that loads happen only when a lease needs them: versions pile up unloaded.
    peer = local_swarm.rollout("rollout", trust=Path(f"{policy_key}.pub"),
                               env={"ECHO2SWARM_ENGINE__THREADS": "1", "ECHO2SWARM_WORKER__MAX_REFIT_SHARE": "0.00001"})
    local_swarm.ready(learner)
    local_swarm.ready(peer)
    stats = wait_until(lambda: (s := _stats(peer))["worker"].get("refits_deferred", 0) >= 5
                       and s["worker"].get("refits", 0) >= 3 and s, 180, interval=0.2,
                       what="deferred versions and loads forced by leases")
    learner_stats = _stats(learner)
    # Loads forced at the edge of the window keep rollouts trainable: hardly any arrive too stale.
    stale = learner_stats.get("refused", {}).get("stale_version", 0)
    assert stale <= 0.05 * learner_stats["accepted"], learner_stats.get("refused")
    held, engine = stats["engine_version"], stats["worker"]
    assert engine.get("refits_failed", 0) == 0 and engine.get("leases_abandoned", 0) == 0
    # The engine lags the newest version (that is the saving) but stays inside the staleness window.
    assert learner_stats["published_version"] - held <= staleness + 1

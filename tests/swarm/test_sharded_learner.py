"""A learner of two ranks (torchrun, FSDP2 over gloo): rollout peers train it as they train one
process, and a rank killed with SIGKILL stops it whole, to resume from the sharded checkpoint with
one rank and with two."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.swarm import LocalSwarm, http_json, learner_toml, read_metrics, wait_until

from echo2swarm.runtime.processes import DaemonProcess, child_pids, loopback_args, pid_alive

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]
PACED = {"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "40", "ECHO2SWARM_ENGINE__THREADS": "1"}


class ShardedLearner(DaemonProcess):
    """`echo2swarm daemon` under torchrun with `ranks` ranks; rank 0 writes daemon.json."""

    def __init__(self, name: str, args: list[str], state_dir: Path, ranks: int, env: dict[str, str] | None = None):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    "--max-restarts=0", "--no-python"]
        super().__init__(name, args, state_dir, env=env, wrap=torchrun)

    def ranks(self) -> list[int]:
        """The rank processes, rank 0 (the daemon's pid in daemon.json) first."""
        pids = child_pids(self.pid)
        daemon = self.info.get("pid")
        return sorted(pids, key=lambda p: p != daemon)

    def _owns(self, info: dict[str, Any]) -> bool:
        """daemon.json's pid is rank 0's, a child of torchrun."""
        return info.get("pid") in child_pids(self.pid)


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for child in child_pids(todo.pop()):
            out.add(child)
            todo.append(child)
    return out


def _start_sharded(swarm: LocalSwarm, name: str, config: Path, ranks: int, state_dir: Path) -> ShardedLearner:
    learner = ShardedLearner(name, [*loopback_args(swarm.swarm, "DEBUG"), "--initial-peers", str(swarm.bootstrap_addr),
                                    "--config", str(config)], state_dir, ranks)
    swarm.daemons.append(learner.start())
    return learner


def _metrics(state_dir: Path) -> Path:
    return state_dir / "run" / "metrics.jsonl"


@pytest.mark.slow
def test_rollout_peers_train_a_two_rank_learner(local_swarm: LocalSwarm, warm_model_dir: Path, policy_key: Path,
                                                tmp_path: Path) -> None:
    # As tests/swarm/test_training.py's resume test trains a single-process learner: 60 steps of 16 x 8.
    config = learner_toml(tmp_path / "learner.toml", warm_model_dir, policy_key, steps=60, checkpoint_every=30,
                          prompts_per_step=16, group_size=8)
    local_swarm.bootstrap()
    state = tmp_path / "learner"
    learner = _start_sharded(local_swarm, "learner", config, 2, state)
    trust = Path(f"{policy_key}.pub")
    peers = [local_swarm.rollout(f"rollout-{i}", trust=trust) for i in (1, 2)]
    for d in (learner, *peers):
        local_swarm.ready(d, timeout=180)
    ranks = learner.ranks()
    assert len(ranks) == 2
    assert learner.proc is not None
    learner.proc.wait(600)  # rank 0 ends training, tells rank 1 to stop; torchrun exits 0
    assert learner.proc.returncode == 0, learner.log_tail(60)
    assert not any(pid_alive(p) for p in ranks), "a rank outlived torchrun"

    records = read_metrics(_metrics(state))
    assert [r["step"] for r in records] == list(range(1, 61))
    assert all(r["version"] == r["step"] for r in records)
    delivered = records[-1]["delivered"]
    assert all(delivered.get(p.info["peer_id"], 0) > 0 for p in peers), delivered
    assert not any(r.get("skipped_nonfinite") for r in records)
    assert sum(sum(r.get("verify_refused", {}).values()) for r in records) == 0  # honest peers, exact checks pass
    first = sum(r["reward_mean"] for r in records[:20]) / 20
    last = sum(r["reward_mean"] for r in records[-20:]) / 20
    assert last > first, f"reward did not rise: {first:.3f} -> {last:.3f}"
    assert (state / "run" / "final" / "model.safetensors").is_file()
    assert (state / "run" / "checkpoints" / "step-00000060" / "state" / ".metadata").is_file()
    # They hold the last versions the two ranks published. The last one is published as the learner
    # exits: a peer still fetching it then gets it only from the other peer, or not at all.
    wait_until(lambda: all(http_json(p.info["chunk_url"] + "/v1/info")["version"] >= 59 for p in peers), 30,
               what="both peers to hold v59 or later")


def _wait_checkpoint(state: Path, step: int, learner: DaemonProcess) -> None:
    path = state / "run" / "checkpoints" / f"step-{step:08d}"

    def written() -> bool:
        assert learner.proc is not None and learner.proc.poll() is None, learner.log_tail(60)
        return path.is_dir()

    wait_until(written, 300, interval=0.2, what=f"the step-{step} checkpoint")


def _stops_whole(learner: ShardedLearner, tree: set[int], victim: int) -> None:
    """SIGKILL `victim` (a rank): torchrun stops the other rank and exits, and no rank is left."""
    os.kill(victim, signal.SIGKILL)
    assert learner.proc is not None
    learner.proc.wait(90)  # torchrun: a rank failed, the rest were stopped (SIGTERM, then SIGKILL)
    assert learner.proc.returncode != 0
    wait_until(lambda: not any(pid_alive(p) for p in tree), 60, what="every rank and its children to exit")


@pytest.mark.slow
def test_a_killed_rank_stops_the_learner_which_resumes_with_one_and_two_ranks(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
) -> None:
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=20, checkpoint_every=5)
    local_swarm.bootstrap()
    state = tmp_path / "learner"
    learner = _start_sharded(local_swarm, "learner-w2", config, 2, state)
    trust = Path(f"{policy_key}.pub")
    peers = [local_swarm.rollout(f"rollout-{i}", trust=trust) for i in (1, 2)]
    for d in (learner, *peers):
        local_swarm.ready(d, timeout=180)
    pids = [p.pid for p in peers]

    # 1. W=2, rank 1 (a training-only rank) killed after the step-5 checkpoint.
    _wait_checkpoint(state, 5, learner)
    rank0, rank1 = learner.ranks()
    _stops_whole(learner, descendants(learner.pid), rank1)
    records = read_metrics(_metrics(state))
    published, seen = max(r["published_version"] for r in records), len(records)

    # 2. One process resumes from the W=2 checkpoint; killed after step 10's.
    single = local_swarm.start("learner-w1", "--config", str(config), state_dir=state)
    local_swarm.ready(single, timeout=180)
    _wait_checkpoint(state, 10, single)
    single.kill()
    records = read_metrics(_metrics(state))
    resumed = records[seen:]
    assert resumed[0]["step"] == 6, "one process resumes after the two ranks' checkpoint"
    assert min(r["version"] for r in resumed) > published, "versions continue strictly upward"
    published, seen = max(r["published_version"] for r in records), len(records)

    # 3. Two ranks resume from the single process's checkpoint; rank 0 (the daemon) killed after step 15's.
    learner = _start_sharded(local_swarm, "learner-w2-again", config, 2, state)
    local_swarm.ready(learner, timeout=180)
    _wait_checkpoint(state, 15, learner)
    rank0, rank1 = learner.ranks()
    tree = descendants(learner.pid)
    p2pd = set(child_pids(rank0))  # a SIGKILLed daemon cannot stop its p2pd (as with one process)
    local_swarm._children.update(p2pd)
    _stops_whole(learner, tree - p2pd, rank0)
    records = read_metrics(_metrics(state))
    assert records[seen]["step"] == 11, "two ranks resume after the single process's checkpoint"
    assert min(r["version"] for r in records[seen:]) > published
    published, seen = max(r["published_version"] for r in records), len(records)

    # 4. Two ranks again: resume at step 16 and finish.
    final = _start_sharded(local_swarm, "learner-w2-last", config, 2, state)
    local_swarm.ready(final, timeout=180)
    assert final.proc is not None
    final.proc.wait(300)
    assert final.proc.returncode == 0, final.log_tail(60)
    records = read_metrics(_metrics(state))
    assert [r["step"] for r in records[seen:]] == list(range(16, 21))
    assert min(r["version"] for r in records[seen:]) > published
    assert (state / "run" / "final" / "model.safetensors").is_file()
    assert [p.pid for p in peers] == pids and all(p.running() for p in peers), "rollout peers stayed"
    for p in peers:  # and reattached: they hold a version of the last run
        assert http_json(p.info["chunk_url"] + "/v1/info")["version"] > published

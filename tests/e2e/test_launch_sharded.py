"""`scripts/launch_learner.sh --nproc-per-node 2`: torchrun starts two ranks, rank 0 is the daemon and
publishes v1 from the shards, both ranks run with the allocator setting the script gives them, and a
stop ends every process it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.swarm import LOOPBACK_OVERLAY, http_json, learner_toml

from echo2swarm.runtime.processes import child_pids, pid_alive, wait_until

REPO = Path(__file__).resolve().parents[2]


def _tree(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for child in child_pids(todo.pop()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


@pytest.mark.timeout(300)
def test_launch_script_starts_two_ranks_that_publish_and_stop_together(
    tmp_path: Path, tiny_model_dir: Path, policy_key: Path
) -> None:
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=5,
                          top={"state_dir": f"{tmp_path}/learner"},
                          sections={"overlay": {**LOOPBACK_OVERLAY, "swarm": "sharded-launch"},
                                    "chunk_server": {"host": "127.0.0.1"}})
    env = {**os.environ, "ECHO2SWARM_BIN": str(Path(sys.executable).parent / "echo2swarm"), "PYTHONUNBUFFERED": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    log_path = tmp_path / "learner.out"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(["bash", str(REPO / "scripts" / "launch_learner.sh"), "--nproc-per-node", "2",
                                     str(config)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def banner() -> str | None:
            text = log_path.read_text()
            if launcher.poll() is not None:
                raise AssertionError(f"the launcher exited ({launcher.returncode}):\n{text[-3000:]}")
            return text if re.search(r"^Prometheus metrics: ", text, re.M) else None

        output = wait_until(banner, 240, interval=0.5, what="rank 0 to print its banner")
        assert "sharded learner: 1 node(s) x 2 rank(s)" in output
        ranks = [p for p in _tree(launcher.pid) if " daemon --config " in _cmdline(p)]
        assert len(ranks) == 2, [(p, _cmdline(p)) for p in _tree(launcher.pid)]
        envs = [_environ(p) for p in ranks]
        assert sorted(e.get("RANK") for e in envs) == ["0", "1"]
        assert all(e.get("MALLOC_MMAP_THRESHOLD_") == "1048576" for e in envs)
        info_url = re.findall(r"^Prometheus metrics: (http://127\.0\.0\.1:\d+)/metrics$", output, re.M)[0] + "/v1/info"
        wait_until(lambda: (http_json(info_url).get("version") or 0) >= 1, 60, what="v1 published from the shards")
        everyone = _tree(launcher.pid) | {launcher.pid}
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)  # what a terminal's Ctrl-C or a service stop sends
        try:
            launcher.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            raise
    wait_until(lambda: not any(pid_alive(p) for p in everyone), 30, what="every rank and p2pd to exit")

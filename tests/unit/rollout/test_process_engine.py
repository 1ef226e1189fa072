"""The engine in a process of its own: same outputs as in the daemon's process, and a host that
dies (or whose daemon dies) never leaves the peer stuck or a process behind.

Real child processes: forked from the session's fork server (`forked_hosts`), as in a local swarm, or
a fresh interpreter importing torch (~4 s here), as a daemon started by hand runs its host: the orphaned
host's test (and tests/e2e/test_two_terminals.py's rollout peer) take that path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from echo2swarm.rollout.engines import SamplingParams, make_engine
from echo2swarm.rollout.engines.host import EngineProcessError, ProcessEngine
from echo2swarm.runtime.devices import check_cpus
from echo2swarm.rollout.engines.runner import ThreadRunner, VersionMismatch
from echo2swarm.runtime.processes import pid_alive, wait_until

PROMPTS = ["12+3=", "7+8=", "abc, 99*3-4="]
SAMPLED = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=11)
GREEDY = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def in_process(model_dir: Path, params: SamplingParams) -> list:
    engine = make_engine("transformers", model_dir, threads=1)
    try:
        return engine.generate(PROMPTS, params)
    finally:
        engine.close()


@pytest.mark.usefixtures("forked_hosts")
def test_outputs_and_refits_match_the_engine_in_process(model_dirs: dict[str, Path]) -> None:
    engine = ProcessEngine("transformers", model_dirs["seed0"], threads=1)
    try:
        assert engine.name == "transformers"
        assert engine.pid != os.getpid() and pid_alive(engine.pid)
        assert engine.generate(PROMPTS, SAMPLED) == in_process(model_dirs["seed0"], SAMPLED)
        assert engine.generate(PROMPTS, GREEDY) == in_process(model_dirs["seed0"], GREEDY)

        seconds = engine.load_weights(model_dirs["seed1"])
        assert 0 < seconds < 30
        after = engine.generate(PROMPTS, SAMPLED)
        assert after == in_process(model_dirs["seed1"], SAMPLED)
        assert after != in_process(model_dirs["seed0"], SAMPLED)

        # Weights that do not fit: the host's ValueError arrives as a ValueError, old weights kept.
        with pytest.raises(ValueError, match="shape mismatch"):
            engine.load_weights(model_dirs["bad_shape"])
        assert engine.generate(PROMPTS, SAMPLED) == after
        assert engine.restarts == 0
        assert engine.busy_s["generate"] > 0 and engine.busy_s["load"] > 0
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(PROMPTS, SAMPLED)
    assert engine.pid is None


@pytest.fixture(params=["process", "thread"])
def runner(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Iterator[ProcessEngine | ThreadRunner]:
    if request.param == "process":
        request.getfixturevalue("forked_hosts")
        built: ProcessEngine | ThreadRunner = ProcessEngine("transformers", model_dirs["seed0"], version=1, threads=1)
    else:
        built = ThreadRunner(make_engine("transformers", model_dirs["seed0"], threads=1), version=1)
    yield built
    built.close()


def test_queued_requests_run_in_order_and_each_batch_says_which_weights_it_ran_on(
    runner: ProcessEngine | ThreadRunner, model_dirs: dict[str, Path],
) -> None:
    # Submitted back to back, no waiting in between: the load lands exactly between the batches.
    first = runner.submit_generate(PROMPTS, SAMPLED, 1)
    load = runner.submit_load(model_dirs["seed1"], 2)
    second = runner.submit_generate(PROMPTS, SAMPLED, 2)
    assert (first.result(60).version, second.result(60).version) == (1, 2)
    assert first.result().groups == in_process(model_dirs["seed0"], SAMPLED)
    assert second.result().groups == in_process(model_dirs["seed1"], SAMPLED)
    assert load.result() > 0 and first.result().busy_s > 0

    # A load that fails leaves v2 in place; a batch queued for v3 behind it is refused, not mislabelled.
    bad = runner.submit_load(model_dirs["bad_shape"], 3)
    stale = runner.submit_generate(PROMPTS, SAMPLED, 3)
    fine = runner.submit_generate(PROMPTS, SAMPLED, 2)
    with pytest.raises(ValueError, match="shape mismatch"):
        bad.result(60)
    with pytest.raises(VersionMismatch, match="holds v2; the batch was submitted for v3"):
        stale.result(60)
    assert fine.result(60).groups == second.result().groups


@pytest.mark.usefixtures("forked_hosts")
def test_pacing_holds_the_engine_for_the_emulated_time(model_dirs: dict[str, Path]) -> None:
    # 12 rollouts at 20 rollouts/s: each batch takes the engine >= 0.6 s, and a queued one waits for it.
    runner = ThreadRunner(make_engine("transformers", model_dirs["seed0"], threads=1), version=1,
                          pace_rollouts_per_s=20)
    try:
        batches = [runner.submit_generate(PROMPTS, SAMPLED, 1) for _ in range(2)]
        busy = [b.result(60).busy_s for b in batches]
        assert min(busy) >= 0.6 - 1e-6
        assert runner.busy_s["generate"] >= 1.2 - 1e-6
    finally:
        runner.close()


@pytest.mark.usefixtures("forked_hosts")
def test_a_killed_host_fails_the_call_and_the_next_call_restarts_on_the_newest_weights(
    model_dirs: dict[str, Path],
) -> None:
    engine = ProcessEngine("transformers", model_dirs["seed0"], threads=1)
    try:
        engine.load_weights(model_dirs["seed1"])
        first = engine.pid
        os.kill(first, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match="exited"):
            engine.generate(PROMPTS, SAMPLED)
        assert not pid_alive(first)
        # A new host, on seed1 (the newest weights that loaded), not on the seed0 it started with.
        assert engine.generate(PROMPTS, SAMPLED) == in_process(model_dirs["seed1"], SAMPLED)
        assert engine.restarts == 1 and engine.pid != first

        # Killed while idle, then asked to refit once the engine has noticed: a new host starts on
        # the new weights. (A request sent in the instant of a death fails like the one above.)
        os.kill(engine.pid, signal.SIGKILL)
        wait_until(lambda: not engine.running, 10, interval=0.05, what="the engine to notice its host died")
        engine.load_weights(model_dirs["seed0"])
        assert engine.restarts == 2
        assert engine.generate(PROMPTS, SAMPLED) == in_process(model_dirs["seed0"], SAMPLED)
    finally:
        engine.close()


def test_the_host_exits_when_its_daemon_is_killed(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from echo2swarm.rollout.engines.host import ProcessEngine
        engine = ProcessEngine("transformers", Path({str(model_dirs["seed0"])!r}), threads=1)
        print(engine.pid, flush=True)
        sys.stdin.read()   # until the test kills us
    """))
    owner = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        host = int(owner.stdout.readline())
        assert pid_alive(host)
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait(timeout=10)
        wait_until(lambda: not pid_alive(host), 15, interval=0.05, what="the orphaned engine host to exit")
    finally:
        owner.kill()
        owner.wait()


@pytest.mark.usefixtures("forked_hosts")
def test_cpus_pin_the_host_and_are_checked(model_dirs: dict[str, Path]) -> None:
    mine = sorted(os.sched_getaffinity(0))
    engine = ProcessEngine("transformers", model_dirs["seed0"], cpus={mine[-1]})
    try:
        assert os.sched_getaffinity(engine.pid) == {mine[-1]}
        assert len(engine.generate(PROMPTS, GREEDY)) == len(PROMPTS)
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"cores \[4096\] this machine does not have; it has 0"):
        check_cpus([4096])
    with pytest.raises(ValueError, match="empty"):
        check_cpus([])


@pytest.mark.usefixtures("forked_hosts")
def test_a_host_that_cannot_build_its_engine_says_why(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises((ValueError, EngineProcessError), match="cannot build the engine"):
        ProcessEngine("transformers", tmp_path, threads=1)

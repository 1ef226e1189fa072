from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers importable as `helpers`
# One OpenMP (torch intra-op) thread in every process the suite starts, unless the caller says otherwise:
# its models are tiny, and beside the other processes of a swarm (or the other worker's) a second thread
# mostly spin-waits. Set before anything imports torch; the launcher and every daemon inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from echo2swarm.runtime.launcher import Launcher  # noqa: E402
from helpers import lanes  # noqa: E402
from helpers.swarm import BootstrapPool, LocalSwarm, log_digest  # noqa: E402

LOG_TAIL_LINES = 60


def _shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory every pytest-xdist worker of this run sees (the workers' common temp root; the
    session's own temp dir when not distributed)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return root / name


def _build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> tuple[Path, Any]:
    """Build `name` once per test run, whichever worker asks first; the others wait on the lock and
    read what it recorded (`build` returns something JSON-serialisable, or None)."""
    from filelock import FileLock

    path = _shared_dir(tmp_path_factory, name)
    done = path.with_suffix(".done.json")
    with FileLock(str(path.with_suffix(".lock"))):
        if not done.exists():
            done.write_text(json.dumps(build(path)))
    return path, json.loads(done.read_text())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from echo2swarm.models.tiny import write_tiny_model

    def build(path: Path) -> None:
        write_tiny_model(path, seed=0)

    return _build_once(tmp_path_factory, "model-tiny", build)[0]


@pytest.fixture(scope="session", autouse=True)
def warm_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The run's own cache of warmed-up models (models/warm_cache.py), shared by the xdist workers and
    the daemons and scripts the tests start: no test reads or fills the machine's ~/.cache, and the
    warm-up `warm_model` runs is the one scripts/launch_learner.sh finds there."""
    from echo2swarm.models.warm_cache import ENV

    path = _shared_dir(tmp_path_factory, "cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(path))
        yield path


@dataclass(frozen=True)
class WarmModel:
    path: Path
    warmup: Any  # echo2swarm.models.warmup.WarmupResult: the steps it ran, its last greedy accuracy on train prompts


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> WarmModel:
    """The demo's starting model, built once a session as `echo2swarm demo` builds it: the tiny model
    after its supervised warm-up on arith until greedy accuracy 0.3 on train prompts (RL has something
    to improve), built once a run (by whichever pytest-xdist worker asks first). Every test that trains
    from a warm model starts from this one; a test that runs the
    demo copies it into the demo's run directory, where the demo finds it and skips its own warm-up.
    `warmup` is what the warm-up returned (recorded as write_tiny_model calls it)."""
    from echo2swarm.cli.demo_run import DEMO_TASKS
    from echo2swarm.models import warmup
    from echo2swarm.models.tiny import write_tiny_model

    arith = DEMO_TASKS["arith"]
    results = []
    real = warmup.supervised_warmup

    def recorded(*args: Any, **kwargs: Any) -> Any:
        results.append(real(*args, **kwargs))
        return results[-1]

    def build(path: Path) -> dict[str, Any]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(warmup, "supervised_warmup", recorded)
            write_tiny_model(path, seed=0, task="arith", warmup_steps=arith.warmup_steps,
                             warmup_accuracy=arith.warmup_accuracy, task_options=arith.options)
        (result,) = results
        return dataclasses.asdict(result)

    path, result = _build_once(tmp_path_factory, "model-warm", build)
    return WarmModel(path, warmup.WarmupResult(**result))


@pytest.fixture(scope="session")
def warm_model_dir(warm_model: WarmModel) -> Path:
    return warm_model.path


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The test's torch threads put back after it (engines and trainers set their own)."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its final norm scaled up 6x, so that sampling otherwise changes choices
    (helpers/verify_lab.py)."""
    from echo2swarm.models.tiny import write_tiny_model
    from helpers.verify_lab import write_peaked_model

    plain = write_tiny_model(tmp_path_factory.mktemp("plain") / "model", seed=0)
    return write_peaked_model(plain, tmp_path_factory.mktemp("peaked") / "model", 6.0)


@pytest.fixture
def policy_key(tmp_path: Path) -> Path:
    from echo2swarm.wire.signing import PolicyKey

    path = tmp_path / "learner.key"
    PolicyKey.generate().save(path)
    return path


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher | None]:
    """The fork server the local swarms' daemons and their engine hosts start from (runtime/launcher.py):
    each would otherwise import torch, transformers and hivemind anew. ECHO2SWARM_TEST_SPAWN=1 spawns
    every daemon as a new interpreter instead, as users' own launches do."""
    if os.environ.get("ECHO2SWARM_TEST_SPAWN") == "1":
        yield None
        return
    started = Launcher(tmp_path_factory.mktemp("launcher")).start()
    _LAUNCHERS.append(started)
    try:
        yield started
    finally:
        started.close()
        _LAUNCHERS.remove(started)


@pytest.fixture(scope="session")
def bootstrap_pool(tmp_path_factory: pytest.TempPathFactory, launcher: Launcher | None) -> Iterator[BootstrapPool]:
    """Bootstraps started a test ahead (helpers/swarm.py `BootstrapPool`): `LocalSwarm.bootstrap()` takes one."""
    pool = BootstrapPool(tmp_path_factory.mktemp("bootstraps"), launcher)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def local_swarm(tmp_path: Path, request: pytest.FixtureRequest, bootstrap_pool: BootstrapPool) -> Iterator[LocalSwarm]:
    """A swarm of this test's own: for a test that kills, restarts or poisons daemons, or that counts
    exactly who is in the swarm."""
    swarm = LocalSwarm(tmp_path / "swarm", swarm="t" + str(abs(hash(request.node.name)) % 10**8), pool=bootstrap_pool)
    if request.node.get_closest_marker("spawn"):
        swarm.launcher = None
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(scope="module")
def module_swarm(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
                 bootstrap_pool: BootstrapPool) -> Iterator[LocalSwarm]:
    """A swarm shared by the tests of one module, ended after its last test: each daemon start costs
    seconds of CPU (torch, hivemind, p2pd), so daemons that several tests only read start once.

    A module builds on it in a module-scoped fixture of its own, which starts the shared daemons
    (usually `module_swarm.bootstrap()`, a learner and its followers) and returns them; a test that
    adds daemons of its own starts them through `module_swarm.joined(tmp_path / "swarm")` and closes
    that view when done (the `joined_swarm` fixture does both). Tests on a shared swarm must leave it
    as they found it for the next: no killed, stopped or restarted shared daemon, no record that
    outlives the test and changes what the others assert. tests/swarm/test_hostile.py shows the use.
    """
    name = request.module.__name__.rsplit(".", 1)[-1]
    swarm = LocalSwarm(tmp_path_factory.mktemp("swarm-" + name), swarm="m" + str(abs(hash(name)) % 10**8),
                       pool=bootstrap_pool)
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture
def joined_swarm(module_swarm: LocalSwarm, tmp_path: Path) -> Iterator[LocalSwarm]:
    """This test's view on the module's shared swarm: daemons started through it end with the test."""
    view = module_swarm.joined(tmp_path / "swarm")
    try:
        yield view
    finally:
        view.close()


@pytest.fixture(scope="module")
def module_policy_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The policy key of a module's shared learner."""
    from echo2swarm.wire.signing import PolicyKey

    path = tmp_path_factory.mktemp("key") / "learner.key"
    PolicyKey.generate().save(path)
    return path


def _swarms(value: Any) -> list[LocalSwarm]:
    """The swarms a fixture value holds: itself, or those among its attributes or items (a module's
    fixture may return a tuple or an object holding its shared swarm)."""
    if isinstance(value, LocalSwarm):
        return [value]
    members = value if isinstance(value, (tuple, list)) else list(getattr(value, "__dict__", {}).values())
    return [m for m in members if isinstance(m, LocalSwarm)]


# -- CPU report: `--cpu-report=N` prints the N tests that used the most CPU, their daemons included ----
# On two workers (or one) the suite is CPU-bound: what makes it long is CPU seconds, which
# --durations does not show (and which `CPU_HEAVY` below is chosen by). A test's CPU is its
# process's and every child it reaped (daemons, p2pd, torchrun) from its setup to its teardown, so a
# module's shared daemons count at the teardown of its last test, and a child reaped late where it is.
_CPU_START = pytest.StashKey[float]()
_WALL = pytest.StashKey[float]()
_CPU_REPORT: list[tuple[float, float, str]] = []
_LAUNCHERS: list[Launcher] = []


def _cpu_seconds() -> float:
    """This process's CPU, its reaped children's, and that of the processes its launcher forked and reaped."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = sum(launcher.reaped_cpu_s() for launcher in _LAUNCHERS)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", type=int, default=0, metavar="N",
                     help="print the N tests that used the most CPU seconds (their daemons included)")


# -- Lanes for two workers, `-n 2 --dist loadscope` (helpers/lanes.py) ---------------------------------
# The modules that keep more than a core busy for a long while (`--cpu-report`): one lane, one after
# another. A module listed here, in ALONE or in APART that no longer exists stops the run (a renamed module must
# not silently leave its lane).
CPU_HEAVY = (
    "tests/hostile/test_sampling_attacks.py",   # ten daemons, five attackers generating at once
    "tests/swarm/test_sharded_learner.py",      # torchrun ranks
    "tests/swarm/test_sharded_ranks.py",
    "tests/e2e/test_demo_poker.py",
    "tests/e2e/test_demo_model.py",             # the default target's warm-up
    "tests/swarm/test_training.py",
    "tests/hostile/test_forged_cards.py",
)
# The demo's test, whose reward rose 0.076 in 200 steps once with other tests beside it (0.1 asserted;
# 0.154 alone, 0.178 beside a busy loop: docs/benchmarks.md), and the Sybil crowd (a hundred p2pd, more
# than a core) comparing the learner's step rate before and during the attack: each runs alone, one after
# another on one worker, with only light modules beside it.
ALONE = (
    "tests/e2e/test_user_flows.py",             # the demo's 150 steps
    "tests/hostile/test_sybil_leases.py",
)
# The other modules that compare the learner's step rate in a window before an attack and one during it.
# Their swarms are paced (about half a core), so another module's daemons beside them leave the rate
# alone; the heavy lane's bursts of two busy cores might not: they never run beside it.
APART = (
    "tests/hostile/test_card_flood.py",
    "tests/hostile/test_held_flood.py",
    "tests/hostile/test_lease_hoarding.py",
    "tests/hostile/test_slow_sources.py",
)
# One process each, about a core, no daemons: what may run beside a module that runs alone.
LIGHT = ("tests/unit/", "tests/bench/")


def pytest_configure(config: pytest.Config) -> None:
    missing = [m for m in (*CPU_HEAVY, *ALONE, *APART) if not (config.rootpath / m).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py CPU_HEAVY, ALONE or APART names modules that do not exist: {missing}")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return lanes.make_scheduler(config, log, CPU_HEAVY, ALONE, LIGHT, APART)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # in one process the order stays the files' own
        lanes.order(items, CPU_HEAVY, ALONE, LIGHT, APART)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_START] = _cpu_seconds()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    measured = dict(report.user_properties)
    if report.when == "teardown" and "cpu_s" in measured:
        _CPU_REPORT.append((measured["cpu_s"], measured.get("wall_s", 0.0), report.nodeid))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    count = config.getoption("cpu_report")
    if not count or not _CPU_REPORT:
        return
    total = sum(cpu for cpu, _, _ in _CPU_REPORT)
    shown = min(count, len(_CPU_REPORT))
    terminalreporter.write_sep("=", f"most CPU: {shown} of {len(_CPU_REPORT)} tests, {total:.0f} CPU s in all")
    for cpu, wall, nodeid in sorted(_CPU_REPORT, reverse=True)[:count]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU s {wall:7.1f} s {cpu / max(wall, 1e-9):4.1f} cores  {nodeid}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A swarm test that fails shows the end of each of its daemons' logs in its report, those of a
    shared swarm included: CI keeps no files, and a failure that shows up once in twenty runs must be
    readable from that one run. Every test's teardown report carries the CPU it used (`--cpu-report`),
    as user properties: they reach pytest-xdist's controller."""
    report: pytest.TestReport = yield
    if report.when == "setup":
        item.stash[_WALL] = report.duration
    elif report.when == "call":
        item.stash[_WALL] = item.stash.get(_WALL, 0.0) + report.duration
    elif report.when == "teardown" and _CPU_START in item.stash:
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_START]))
        report.user_properties.append(("wall_s", item.stash.get(_WALL, 0.0) + report.duration))
    if report.when == "call" and report.failed:
        seen: set[int] = set()
        for value in getattr(item, "funcargs", {}).values():
            for swarm in _swarms(value):
                for daemon in swarm.all_daemons():
                    if id(daemon) not in seen:
                        seen.add(id(daemon))
                        report.sections.append((f"daemon log: {daemon.name}", log_digest(daemon, LOG_TAIL_LINES)))
    return report

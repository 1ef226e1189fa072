from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers importable as `helpers`

from helpers.swarm import LocalSwarm  # noqa: E402

LOG_TAIL_LINES = 60


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from echo2swarm.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after a short supervised warm-up on arith: RL has something to improve."""
    from echo2swarm.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "warm", seed=0, task="arith",
                            warmup_steps=3000, warmup_accuracy=0.3)


@pytest.fixture
def policy_key(tmp_path: Path) -> Path:
    from echo2swarm.wire.signing import PolicyKey

    path = tmp_path / "learner.key"
    PolicyKey.generate().save(path)
    return path


@pytest.fixture
def local_swarm(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(tmp_path / "swarm", swarm="t" + str(abs(hash(request.node.name)) % 10**8))
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A swarm test that fails shows the end of each of its daemons' logs in its report: CI keeps
    no files, and a failure that shows up once in twenty runs must be readable from that one run."""
    report: pytest.TestReport = yield
    swarm = getattr(item, "funcargs", {}).get("local_swarm")
    if report.when == "call" and report.failed and isinstance(swarm, LocalSwarm):
        for name, tail in swarm.log_tails(LOG_TAIL_LINES):
            report.sections.append((f"daemon log: {name}", tail))
    return report

"""Fixtures the engine tests share: one torch thread in the test process, the model directories, and
engine hosts forked from the session's fork server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.models import engine_model_dirs

from echo2swarm.runtime.launcher import ENV as LAUNCHER_ENV


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    # Reference forwards run in the test process itself; on a busy 2-core box two intra-op
    # threads make these tiny matmuls ~10x slower (OpenMP spin-waits), one thread never does.
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """seed0, seed1, and seed1 broken two ways (`bad_shape`, `bad_keys`): see helpers/models.py."""
    return engine_model_dirs(tmp_path_factory.mktemp("engine"))


@pytest.fixture
def forked_hosts(launcher: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """ProcessEngine hosts forked from the session's fork server (runtime/launcher.py), as a local swarm's
    daemons and `echo2swarm demo` start theirs, instead of a new interpreter importing torch each
    (~4 CPU s a host)."""
    if launcher is not None:  # ECHO2SWARM_TEST_SPAWN=1: every host a new interpreter
        launcher.ready()  # it listens once it has imported torch and the rest
        monkeypatch.setenv(LAUNCHER_ENV, str(launcher.sock_path))

"""Fixtures the engine tests share: one torch thread in the test process, and the model directories."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.models import engine_model_dirs


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

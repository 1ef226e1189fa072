"""Task tests: datasets writes its Arrow cache under the test's tmp dir, never in ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import datasets.config
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")

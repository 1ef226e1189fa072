"""scripts/bench_learner.py must run where only torch, transformers, safetensors, tokenizers and pydantic are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(180)
def test_bench_learner_imports_nothing_of_the_swarm() -> None:
    code = (
        "import runpy, sys; runpy.run_path('scripts/bench_learner.py'); "
        "import echo2swarm.train.distributed; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hivemind', 'aiohttp', 'click', 'cryptography'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

"""scripts/bench_gpu.py must run where only torch, transformers, safetensors, tokenizers and pydantic are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).parents[2]


def test_bench_gpu_imports_nothing_of_the_swarm() -> None:
    code = (
        "import runpy, sys; runpy.run_path('scripts/bench_gpu.py'); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hivemind', 'aiohttp', 'click', 'cryptography'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

"""A model directory from a template's files and new weights: what the benchmarks' and tests' labs
write for each version they publish without the swarm's signed version store (learner/versions.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["write_model_dir"]

WEIGHTS_INDEX = "model.safetensors.index.json"


def write_model_dir(template: Path, out: Path, weights: bytes) -> Path:
    """`out` (created; must not exist): `weights` as its one model.safetensors beside the template's
    other files (config, tokenizer). The template's weights and shard index are left out: one file
    replaces them."""
    out.mkdir(parents=True)
    for f in Path(template).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != WEIGHTS_INDEX:
            shutil.copy(f, out / f.name)
    (out / "model.safetensors").write_bytes(weights)
    return out

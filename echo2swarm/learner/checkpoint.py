"""Learner checkpoints: model, optimizer, step, version, RNG and the prompt cursor, written atomically.

    run_dir/checkpoints/step-00000040/model.safetensors   policy weights
                                     /state.pt            optimizer, RNG, step, version, lease cursor

A checkpoint directory appears under its final name only when complete (tmp dir + rename), so a
learner killed mid-write resumes from the previous one.
"""

from __future__ import annotations

import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from echo2swarm.policy.store import atomic_dir
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
_STEP_DIR = re.compile(r"step-(\d{8,})")


@dataclass
class Checkpoint:
    path: Path
    step: int                 # steps completed
    version: int              # version of the policy in model.safetensors
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]     # optimizer, rng, lease cursor, extra


def save_checkpoint(run_dir: Path, *, step: int, version: int, weights: bytes, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any], keep: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    with atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_bytes(weights)
        torch.save({
            "step": step,
            "version": version,
            "optimizer": optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "extra": extra,
        }, tmp / "state.pt")
    for old in sorted(_steps(root))[:-keep]:
        shutil.rmtree(root / f"step-{old:08d}", ignore_errors=True)
    return final


def _steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir())


def load_latest(run_dir: Path) -> Checkpoint | None:
    root = Path(run_dir) / "checkpoints"
    for step in reversed(_steps(root)):
        path = root / f"step-{step:08d}"
        try:
            # Our own file, written atomically. On the CPU: a GPU learner's optimizer state then loads on
            # any machine, and optimizer.load_state_dict moves it to the parameters' device.
            state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")
            tensors = load_file(path / "model.safetensors")
        except Exception as e:  # a damaged checkpoint: fall back to the one before
            logger.warning("checkpoint %s unreadable (%s); trying an older one", path, e)
            continue
        return Checkpoint(path, int(state["step"]), int(state["version"]), tensors, state)
    return None


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])

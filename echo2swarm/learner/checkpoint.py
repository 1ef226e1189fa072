"""Learner checkpoints: model, optimizer, step, version, RNG and the prompt cursor, written atomically.

    run_dir/checkpoints/step-00000040/state/    policy + AdamW state (torch.distributed.checkpoint:
                                                every rank writes its own shards; names as in the
                                                unsharded model, so W ranks or one process load it)
                                     /meta.pt   step, version, lease cursor, RNG, extra (rank 0)

A checkpoint directory appears under its final name only when complete (tmp dir + rename, by
rank 0 once every rank's shards are written), so a learner killed mid-write resumes from the
previous one. The ranks of a multi-node learner must see `run_dir` at the same path (a shared
filesystem). Checkpoints of the earlier format (model.safetensors + state.pt) still resume.
"""

from __future__ import annotations

import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from echo2swarm.policy.store import atomic_dir
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
_STEP_DIR = re.compile(r"step-(\d{8,})")
STATE_DIR = "state"
META_FILE = "meta.pt"


@dataclass
class Checkpoint:
    path: Path
    step: int                 # steps completed
    version: int              # version of the policy the checkpoint holds
    state: dict[str, Any]     # rng, lease cursor (extra); the optimizer too in the earlier format

    def restore(self, trainer: Any) -> None:
        """Load the policy and optimizer into ``trainer`` (every rank takes part) and rank 0's RNG."""
        if (self.path / STATE_DIR).is_dir():
            with warnings.catch_warnings():  # one process: DCP says it assumes so, which is right
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                trainer.load_state(self.path / STATE_DIR)
        else:  # the earlier format: full weights and a plain optimizer state dict
            trainer.load_weights(load_file(self.path / "model.safetensors"))
            if getattr(trainer, "world", 1) == 1:
                trainer.optimizer.load_state_dict(self.state["optimizer"])
            else:
                logger.warning("%s: a single-process checkpoint; its optimizer state does not fit the shards, "
                               "AdamW restarts from zero", self.path)
        torch.set_rng_state(self.state["torch_rng"])
        random.setstate(self.state["python_rng"])


def save_checkpoint(run_dir: Path, *, step: int, version: int, trainer: Any, extra: dict[str, Any],
                    keep: int) -> Path:
    """Write step ``step``'s checkpoint (rank 0 calls this; ``trainer.save_state`` brings every rank)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    with atomic_dir(final) as tmp:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            trainer.save_state(tmp / STATE_DIR)
        torch.save({
            "step": step,
            "version": version,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "extra": extra,
        }, tmp / META_FILE)
    for old in sorted(_steps(root))[:-keep]:
        shutil.rmtree(root / f"step-{old:08d}", ignore_errors=True)
    return final


def _steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir())


def load_latest(run_dir: Path) -> Checkpoint | None:
    """The newest readable checkpoint (its step, version and small state; `restore` loads the rest)."""
    root = Path(run_dir) / "checkpoints"
    for step in reversed(_steps(root)):
        path = root / f"step-{step:08d}"
        try:
            # Our own files, written atomically. On the CPU: a GPU learner's state loads on any machine.
            if (path / STATE_DIR / ".metadata").is_file():
                state = torch.load(path / META_FILE, weights_only=False, map_location="cpu")
            else:
                state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")
                if not (path / "model.safetensors").is_file():
                    raise FileNotFoundError("model.safetensors")
        except Exception as e:  # a damaged checkpoint: fall back to the one before
            logger.warning("checkpoint %s unreadable (%s); trying an older one", path, e)
            continue
        return Checkpoint(path, int(state["step"]), int(state["version"]), state)
    return None

"""Model directories the engine tests share: two tiny models and two broken variants of the second."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from echo2swarm.models.tiny import write_tiny_model


def engine_model_dirs(root: Path) -> dict[str, Path]:
    """seed0 and seed1 tiny models, plus seed1 with one tensor of the wrong shape (`bad_shape`),
    with one tensor renamed, so one is left out and one is unknown to the model (`bad_keys`), and
    with its file cut short, as by a full disk (`truncated`)."""
    dirs = {"seed0": write_tiny_model(root / "seed0", seed=0), "seed1": write_tiny_model(root / "seed1", seed=1)}
    tensors = load_file(dirs["seed1"] / "model.safetensors")
    bad_shape = root / "bad_shape"
    shutil.copytree(dirs["seed1"], bad_shape)
    save_file(
        {**tensors, "model.layers.0.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"][:-1]},
        bad_shape / "model.safetensors",
    )
    bad_keys = root / "bad_keys"
    shutil.copytree(dirs["seed1"], bad_keys)
    renamed = dict(tensors)
    renamed["model.layers.1.mlp.gate_proj.weight_typo"] = renamed.pop("model.layers.1.mlp.gate_proj.weight")
    save_file(renamed, bad_keys / "model.safetensors")
    truncated = root / "truncated"
    shutil.copytree(dirs["seed1"], truncated)
    with open(truncated / "model.safetensors", "r+b") as handle:
        handle.truncate((truncated / "model.safetensors").stat().st_size - 4096)
    dirs.update(bad_shape=bad_shape, bad_keys=bad_keys, truncated=truncated)
    return dirs

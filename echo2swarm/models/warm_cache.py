"""A machine's cache of warmed-up tiny models: `echo2swarm demo`, `echo2swarm tiny-model --task` and
scripts/launch_learner.sh pay the supervised warm-up once per recipe, not at every run.

    write_tiny_model(recipe) ── lookup(recipe) ── hit: copy the entry's files into the new model dir
                                              └── miss: build, warm up, save ── store(recipe, dir, result)

An entry is `<cache>/tiny-models/<key>/`: the model directory's files plus `recipe.json` (the recipe
and what the warm-up returned). The key is a SHA-256 over the recipe (seed, task, task options, warm-up
steps and target, config overrides) and what else decides the weights: the torch and transformers
versions and the source of echo2swarm's models/ and tasks/ packages (a checkout that changes the warm-up
or a task misses). An entry is written under a temporary name and renamed into place, so a reader sees a
whole entry or none; one that does not read back (files missing, recipe not matching) is a miss.

Where: `$ECHO2SWARM_CACHE_DIR`, else `$XDG_CACHE_HOME/echo2swarm`, else `~/.cache/echo2swarm`;
`ECHO2SWARM_CACHE_DIR=off` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from echo2swarm.models.warmup import WarmupResult

logger = logging.getLogger(__name__)

__all__ = ["ENV", "cache_dir", "lookup", "recipe_key", "store"]

ENV = "ECHO2SWARM_CACHE_DIR"
OFF = "off"
RECIPE_FILE = "recipe.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is off."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "echo2swarm"


def _versions() -> dict[str, str]:
    import torch
    import transformers

    package = Path(__file__).resolve().parents[1]
    source = hashlib.sha256()
    for path in sorted([*(package / "models").glob("*.py"), *(package / "tasks").glob("*.py")]):
        source.update(path.name.encode() + b"\0" + path.read_bytes())
    return {"source": source.hexdigest(), "torch": torch.__version__, "transformers": transformers.__version__}


def recipe_key(recipe: Mapping[str, Any]) -> str:
    """The entry's name: a digest of the recipe and the versions that decide the weights."""
    text = json.dumps({"recipe": recipe, "versions": _versions()}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _entry(root: Path, recipe: Mapping[str, Any]) -> Path:
    return root / "tiny-models" / recipe_key(recipe)


def lookup(recipe: Mapping[str, Any], out_dir: Path) -> WarmupResult | None:
    """Copy the cached model for `recipe` into `out_dir` (an empty directory) and return what its
    warm-up did; None (nothing copied) when there is no whole entry or the cache is off."""
    root = cache_dir()
    if root is None:
        return None
    entry = _entry(root, recipe)
    copied: list[Path] = []
    try:
        saved = json.loads((entry / RECIPE_FILE).read_text())
        if (not isinstance(saved, dict) or saved.get("recipe") != json.loads(json.dumps(recipe))
                or not all((entry / f).is_file() for f in REQUIRED_FILES)):
            raise ValueError("entry does not match its recipe")
        result = WarmupResult(**saved["result"])
        for f in entry.iterdir():
            if f.is_file() and f.name != RECIPE_FILE:
                copied.append(out_dir / f.name)
                shutil.copy(f, copied[-1])
    except (OSError, ValueError, TypeError, KeyError) as e:
        for path in copied:  # `out_dir` was empty: leave it so for the warm-up
            path.unlink(missing_ok=True)
        if copied or not isinstance(e, FileNotFoundError):  # no entry at all is a plain miss
            logger.warning("ignoring the damaged warm model cache entry %s (%s); warming up again", entry, e)
        return None
    logger.info("warm model from the cache %s (%d warm-up steps, accuracy %s)", entry, result.steps, result.accuracy)
    return result


def store(recipe: Mapping[str, Any], model_dir: Path, result: WarmupResult) -> Path | None:
    """Keep a copy of `model_dir` as the entry for `recipe`. A cache that cannot be written is
    logged and skipped: the model is already where it was asked for."""
    root = cache_dir()
    if root is None:
        return None
    entry, staging = _entry(root, recipe), None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        for f in model_dir.iterdir():
            if f.is_file():
                shutil.copy(f, staging / f.name)
        (staging / RECIPE_FILE).write_text(json.dumps({"recipe": recipe, "result": asdict(result)}, indent=1))
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)
        os.replace(staging, entry)
    except OSError as e:
        logger.warning("could not keep the warm model in the cache %s (%s); set %s to a writable directory, "
                       "or to 'off'", root, e, ENV)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        return None
    return entry

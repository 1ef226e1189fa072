"""EngineWeights (rollout/refit.py): the versions the engine still reads from disk, and an engine
process that dies after the store has moved on two versions past the one it holds."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from echo2swarm.config.loading import load_config
from echo2swarm.policy.manifest import Manifest, SignedManifest, file_entry, sha256_hex
from echo2swarm.wire.signing import PolicyKey
from echo2swarm.policy.store import ChunkStore, VersionStore, collect_garbage
from echo2swarm.rollout.engines.base import SamplingParams
from echo2swarm.rollout.refit import EngineWeights
from echo2swarm.runtime.processes import wait_until

pytestmark = pytest.mark.timeout(240)
PARAMS = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=0)


def weights_for(tmp_path: Path, isolate: bool, max_refit_share: float = 0.05) -> EngineWeights:
    config = load_config("rollout", None, environ={}, overrides={
        "state_dir": str(tmp_path / "state"),
        "engine": {"type": "transformers", "threads": 1, "isolate": isolate},
        "worker": {"max_refit_share": max_refit_share},
    })
    return EngineWeights(config, Counter())


def install(versions: VersionStore, chunks: ChunkStore, key: PolicyKey, version: int, model_dir: Path) -> Path:
    """`model_dir` installed as `version`, as the follower installs a verified version."""
    entries, pieces = [], []
    for path in sorted(model_dir.iterdir()):
        entry, parts = file_entry(path.name, path.read_bytes(), 1 << 20)
        entries.append(entry)
        pieces += parts
    for piece in pieces:
        chunks.put(sha256_hex(piece), piece)
    manifest = Manifest(swarm="t", version=version, created_ms=0, chunk_size=1 << 20, files=entries)
    return versions.install(manifest, SignedManifest.sign(manifest, key).to_bytes(), chunks)


async def settle(condition: Callable[[], Any], what: str, timeout: float = 60.0) -> None:
    """Yield to the loop (the refit's completion runs there) until `condition()` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.01)  # the poll interval of this deadline-bounded wait, yielding to the loop


def test_the_versions_in_use_follow_queued_loads_and_their_outcome(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    weights = weights_for(tmp_path, isolate=False)

    async def scenario() -> None:
        await weights.on_version(1, model_dirs["seed0"])
        assert weights.in_use() == {1}
        await weights.on_version(2, model_dirs["seed1"])
        await weights.refit()  # queued now whatever the refit budget said
        assert weights.in_use() == {1, 2}  # the load may not have run yet: both stay on disk
        await settle(lambda: weights.stats["refits"] == 1, "the load of v2")
        assert weights.in_use() == {2} and weights.loaded == 2

        await weights.on_version(3, model_dirs["bad_shape"])
        await weights.refit()
        assert weights.in_use() == {2, 3}
        await settle(lambda: weights.stats["refits_failed"] == 1, "the failed load of v3")
        assert weights.in_use() == {2} and weights.version == 2  # the engine kept v2's weights

    try:
        asyncio.run(scenario())
    finally:
        weights.close()


@pytest.mark.usefixtures("forked_hosts")
def test_a_killed_engine_process_restarts_on_the_version_it_held_after_newer_ones_arrived(
    tmp_path: Path, model_dirs: dict[str, Path],
) -> None:
    """The engine holds v2 while v3 and v4 wait for the refit budget; the store keeps two versions.
    Garbage collection must leave v2 on disk: a new engine process starts from it."""
    key, chunks, versions = PolicyKey.generate(), ChunkStore(tmp_path / "store"), VersionStore(tmp_path / "store")
    weights = weights_for(tmp_path, isolate=True, max_refit_share=1e-9)  # only the first refit is due

    async def scenario() -> None:
        await weights.on_version(1, install(versions, chunks, key, 1, model_dirs["seed0"]))
        await weights.on_version(2, install(versions, chunks, key, 2, model_dirs["seed1"]))
        await settle(lambda: weights.stats["refits"] == 1, "the load of v2")
        for v in (3, 4):
            await weights.on_version(v, install(versions, chunks, key, v, model_dirs["seed0" if v == 3 else "seed1"]))
        assert weights.stats["refits_deferred"] == 2 and weights.version == 2
        assert collect_garbage(versions, chunks, 2, weights.in_use()) == [1]

    try:
        asyncio.run(scenario())
        engine = weights.engine
        first = engine.pid
        os.kill(first, signal.SIGKILL)
        # A request sent while the host dies fails (the runner's contract); the next one restarts it.
        wait_until(lambda: not engine.running, 15, interval=0.05, what="the engine to see its process die")
        batch = weights.submit_batch(["12+3="], PARAMS).result(timeout=120)
        assert batch.version == 2 and len(batch.groups) == 1 and len(batch.groups[0]) == 2
        assert engine.restarts == 1 and engine.pid != first
    finally:
        weights.close()

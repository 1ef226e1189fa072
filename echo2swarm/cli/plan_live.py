"""The live half of `echo2swarm plan`: peers' cards and the learner's measured times (imports hivemind)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from echo2swarm.cli._common import fail


def live_inputs(addrs: list[str], swarm: str, timeout: float) -> tuple[dict[str, Any], list[Any]]:
    """(capacity numbers the learner measured, rollout peers with their µ and price)."""
    from pydantic import ValidationError

    from echo2swarm.config.models import OverlayConfig

    try:
        config = OverlayConfig(swarm=swarm, initial_peers=addrs, client_mode=True, bootstrap_timeout_s=timeout,
                               host_maddrs=[])
    except ValidationError as e:
        fail(f"--initial-peers/--swarm: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
    return asyncio.run(_read(config, timeout))


async def _learner_info(url: str, timeout: float) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(f"{url}/v1/info") as resp:
            resp.raise_for_status()
            return json.loads(await resp.read())


async def _read(config: Any, timeout: float) -> tuple[dict[str, Any], list[Any]]:
    from echo2swarm.control.activation import Worker
    from echo2swarm.overlay.node import BootstrapError, Overlay

    try:
        overlay = await Overlay.start(config, client_mode=True)
    except BootstrapError as e:
        fail(str(e))
    try:
        heads, _ = await overlay.get_heads()
        overlay.shards_from(heads)
        publishers = [h.publisher for h in sorted(heads, key=lambda h: -h.version) if h.signature_ok()]
        cards, _ = await overlay.get_cards(prefer=publishers)
    finally:
        await overlay.stop()
    # Head publishers first: only the learner signs cards under its peer id, but anyone can sign a
    # card that says "learner" under a key of their own.
    learners = sorted((c for c in cards if c.role == "learner" and c.state != "stopping" and c.chunk_url),
                      key=lambda c: c.peer_id not in publishers)
    if not learners:
        fail(f"no learner in swarm '{config.swarm}' yet: type --rollouts-per-step and --t-train with --workers instead")
    measured: dict[str, Any] = {}
    delivered: dict[str, float] = {}
    try:
        info = await _learner_info(learners[0].chunk_url, timeout)  # type: ignore[arg-type]
        capacity = info.get("stats", {}).get("capacity") or {}
        delivered = {str(k): float(v) for k, v in (capacity.get("delivered_mu") or {}).items() if v}
        for key in ("rollouts_per_step", "t_train", "t_bcast", "l_gen", "staleness", "publish_every", "gamma"):
            if capacity.get(key) is not None:
                measured[key] = capacity[key]
    except Exception as e:  # the learner's HTTP server may be unreachable from here (NAT)
        fail(f"cannot read the learner's measurements at {learners[0].chunk_url}/v1/info ({e}); "
             "type --rollouts-per-step and --t-train")
    workers = []
    for c in cards:
        mu = delivered.get(c.peer_id, c.rollouts_per_s) if c.role == "rollout" and c.state != "stopping" else None
        if mu is not None:
            workers.append(Worker(c.peer_id, mu=float(mu), price=c.price))
    if not workers:
        fail(f"no rollout peer in swarm '{config.swarm}' has measured its rollouts/s yet; try again shortly")
    if "t_train" not in measured:
        fail("the learner has not finished a training step yet, so T_train is unknown: pass --t-train")
    return measured, workers

"""Two real overlay nodes in this process (real p2pd, real DHT), the second bootstrapped from the first."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.node import Overlay

LOOPBACK_TCP = ["/ip4/127.0.0.1/tcp/0"]
LOOPBACK_QUIC = ["/ip4/127.0.0.1/udp/0/quic-v1"]


@asynccontextmanager
async def overlay_pair(swarm: str, host_maddrs: list[str] = LOOPBACK_TCP) -> AsyncIterator[tuple[Overlay, Overlay]]:
    """`async with overlay_pair("demo") as (a, b):` b joined a's new swarm; both stopped on the way out."""
    a = await Overlay.start(OverlayConfig(swarm=swarm, new_swarm=True, host_maddrs=host_maddrs))
    try:
        b = await Overlay.start(OverlayConfig(swarm=swarm, initial_peers=await a.visible_maddrs(),
                                              host_maddrs=host_maddrs))
        try:
            yield a, b
        finally:
            await b.stop()
    finally:
        await a.stop()

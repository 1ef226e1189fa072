"""A DHT read that never finishes, not even when cancelled, must not hold its reader (overlay/cards.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from echo2swarm.config.models import OverlayConfig
from echo2swarm.overlay.cards import MAX_STUCK_READS, READ_TIMEOUTS, CardReader


class StuckNode:
    """A DHT node whose lookups hang and swallow their cancellation, as a libp2p call stuck in p2pd does."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def get_many(self, keys: list[str], sufficient_expiration_time: float) -> dict[str, Any]:
        self.calls += 1
        while True:
            try:
                await self.release.wait()
                return {}
            except asyncio.CancelledError:
                continue


def test_a_read_stuck_past_its_cancellation_finds_nothing_in_bounded_time() -> None:
    async def scenario() -> None:
        config = OverlayConfig(dht_timeout_s=0.05)
        node = StuckNode()
        reader = CardReader(config, node, validator=None, work=None)  # type: ignore[arg-type]
        started = time.monotonic()
        assert await reader.get_dict("s/head") == []
        assert await reader.get_dict("s/head") == []  # and the next read is bounded too
        assert time.monotonic() - started < 2 * READ_TIMEOUTS * config.dht_timeout_s + 1.0
        assert reader.reads["timed_out"] == 2 and node.calls == 2
        node.release.set()  # the abandoned lookups end whenever they do; nobody waits for them
        await asyncio.sleep(0)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_stuck_reads_left_behind_are_bounded() -> None:
    # Past MAX_STUCK_READS reads that have not ended, a read begins no DHT lookup: what is left behind
    # stays bounded however long p2pd stays stuck; once they end, reads go out again.
    async def scenario() -> None:
        config = OverlayConfig(dht_timeout_s=0.01)
        node = StuckNode()
        reader = CardReader(config, node, validator=None, work=None)  # type: ignore[arg-type]
        for _ in range(MAX_STUCK_READS + 3):
            assert await reader.get_dict("s/head") == []
        assert node.calls == MAX_STUCK_READS and reader.reads["timed_out"] == MAX_STUCK_READS + 3
        node.release.set()
        while reader._stuck:  # the abandoned lookups end, and with them the gathers left behind (bounded
            await asyncio.sleep(0)  # by the scenario's wait_for): a yield to the loop, no timing
        node.release = asyncio.Event()
        node.release.set()
        assert await reader.get_dict("s/head") == [] and node.calls == MAX_STUCK_READS + 1
        assert reader.reads["timed_out"] == MAX_STUCK_READS + 3  # this one ended in time

    asyncio.run(asyncio.wait_for(scenario(), 30))

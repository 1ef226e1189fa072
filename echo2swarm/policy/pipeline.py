"""The version a follower is fetching right now, so its chunk server can re-serve it while it arrives.

    fetcher ── chunk k verified and stored ──► InFlight.arrived(k) ──► wakes requests waiting for k
    server  ── GET chunk k of the version in flight ──► InFlight.wait(k) ──► stream k once it is stored

This is what makes the broadcast pipelined: a peer forwards chunk k to the next peer of the chain
while it still fetches k+1, instead of answering 404 until the whole version is installed.

The chunk server holds a request only for a version this peer has seen signed (`signed`: the
manifest of the fetch in flight was verified before `begin`), never for a version a requester
merely names. A request for a version newer than anything this peer knows is answered at once and
pokes its follower (`nudge`: the requester has seen the head already), at most once per
`POKE_INTERVAL_S`, so a flood of such requests costs the follower at most one early DHT read a second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from echo2swarm.policy.manifest import ChunkRef, Manifest

POKE_INTERVAL_S = 1.0  # seconds between two pokes of the follower caused by requests


class InFlight:
    def __init__(self, poke: Callable[[], None] = lambda: None):
        self.version: int | None = None
        self.manifest_bytes: bytes | None = None
        self.poke = poke
        self._expected: dict[str, asyncio.Event] = {}
        self._begun = asyncio.Event()
        self._last_poke = float("-inf")

    def begin(self, manifest: Manifest, envelope: bytes, held: set[str], refs: list[ChunkRef] | None = None) -> None:
        """A fetch of `manifest` begins: its chunks (`refs`, a delta path's; else the default path's) arrive."""
        self.version = manifest.version
        self.manifest_bytes = envelope
        self._expected = {}
        for ref in manifest.chunk_refs() if refs is None else refs:
            event = self._expected.setdefault(ref.sha256, asyncio.Event())
            if ref.sha256 in held:
                event.set()
        self._begun.set()
        self._begun = asyncio.Event()

    def arrived(self, sha256: str) -> None:
        event = self._expected.get(sha256)
        if event is not None:
            event.set()

    def end(self) -> None:
        """The fetch finished or failed: release every waiter (they then find the chunk stored or not)."""
        for event in self._expected.values():
            event.set()
        self._expected = {}
        self.version = None
        self.manifest_bytes = None

    def expects(self, sha256: str) -> bool:
        return sha256 in self._expected

    def have_count(self) -> int:
        return sum(1 for e in self._expected.values() if e.is_set())

    def signed(self, version: int) -> bool:
        """Whether `version` is the one being fetched: its signed manifest was verified before `begin`."""
        return self.version is not None and version == self.version

    def nudge(self) -> bool:
        """Poke the follower unless a request did so less than `POKE_INTERVAL_S` ago. True: poked."""
        now = time.monotonic()
        if now - self._last_poke < POKE_INTERVAL_S:
            return False
        self._last_poke = now
        self.poke()
        return True

    async def wait(self, sha256: str, timeout: float, newer_than: int | None = None, version: int | None = None) -> None:
        """Wait up to `timeout` s for `sha256` to arrive, if this peer is fetching (or about to fetch) it.

        With `version` newer than `newer_than` and the version in flight, it first pokes the
        follower and waits for that fetch to begin. `ChunkService` never passes `version`: it holds
        requests only for the signed version in flight.
        """
        deadline = time.monotonic() + timeout
        if not self.expects(sha256) and version is not None and version > max(self.version or 0, newer_than or 0):
            self.nudge()
            begun = self._begun
            try:
                await asyncio.wait_for(begun.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return
        event = self._expected.get(sha256)
        if event is None:
            return
        try:
            await asyncio.wait_for(event.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return

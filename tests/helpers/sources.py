"""A scripted chunk source for fetcher tests: serves the chunks it is given, or fails each ask with one fault."""

from __future__ import annotations

from echo2swarm.policy.manifest import ChunkRef
from echo2swarm.policy.sources import Progress, SourceError


class FakeSource:
    """Stands in for a peer (pure fetcher logic): `asked` lists every chunk asked of it, in order."""

    def __init__(self, name: str, data: dict[str, bytes], fault: type[SourceError] | None = None):
        self.name, self.peer_id = name, name
        self.data = data
        self.fault = fault
        self.asked: list[str] = []

    async def manifest(self, version: int, max_bytes: int, progress: Progress | None = None) -> bytes:
        raise NotImplementedError

    async def plan(self, version: int, max_bytes: int) -> bytes:
        raise NotImplementedError

    async def chunk(self, ref: ChunkRef, wait: float = 0.0, version: int | None = None,
                    progress: Progress | None = None) -> bytes:
        self.asked.append(ref.sha256)
        if self.fault is not None:
            raise self.fault(f"{self.name}: {self.fault.__name__}")
        return self.data[ref.sha256]

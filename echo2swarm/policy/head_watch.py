"""Long-polls of the learner's head: held until a newer head is out, with its broadcast plan.

    follower ─GET /v1/head?after=V&wait=S─► ChunkServer ─► HeadWatch.wait_newer(V, S)
    version store installs v ─► HeadWatch.wake(v) ─► one task re-reads the head until v's is ready
                                                  ─► every waiter for a head newer than V is answered

The request is held (at most `chunk_server.wait_s`, in the server's `waiting` budget) until a head
newer than `after` is published and its broadcast plan served, else answered at the end of the wait
with the current head; the follower verifies it like a head read from the DHT.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

HEAD_RECHECK_S = 0.02  # after a version is installed: seconds between reads of the head until the new one is out
HEAD_SETTLE_S = 2.0  # ... for at most this long; then waiters get whatever head there is (no plan, say)


class HeadWatch:
    """Long-polls of the head: `wait_newer(after, timeout)` returns once a head newer than `after` is
    out and `ready` (its broadcast plan is served, so followers find their parents at once).

    `wake(version)` (from any thread: the version store calls it when it installs a version) marks
    that version as coming; while anyone waits, one task reads the head every HEAD_RECHECK_S until a
    ready head of that version (or newer) is out, for at most HEAD_SETTLE_S after the wake (then it
    takes whatever newer head there is, plan or not), releasing the waiters as each newer head comes
    out. Otherwise the head is read once when a request comes and once when it is answered.

    >>> watch = HeadWatch(head=lambda: signed_head_json, ready=lambda v: plan(v) is not None)
    >>> data = await watch.wait_newer(after=6, timeout=10.0)   # v7's head, or the current one at timeout
    """

    def __init__(self, head: Callable[[], bytes | None], ready: Callable[[int], bool] = lambda version: True):
        self.head = head
        self.ready = ready
        self.version = 0  # the newest ready head's version seen
        self.waiters = 0
        self._coming = 0  # the newest version installed (woken for), whose head may not be out yet
        self._woken_at = float("-inf")
        self._changed: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._settling: asyncio.Task[None] | None = None

    def _current(self) -> tuple[int, bytes | None]:
        data = self.head()
        if data is None:
            return 0, None
        try:
            version = json.loads(data)["version"]
        except (ValueError, KeyError, TypeError):
            return 0, data
        return (version if isinstance(version, int) else 0), data

    def bind(self) -> None:
        """Attach to the running loop (the server's): `wake` is then safe from any thread."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Condition()

    def wake(self, version: int) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._woke, version)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _woke(self, version: int) -> None:
        self._coming = max(self._coming, version)
        self._woken_at = time.monotonic()
        self._settle()

    def _settle(self) -> None:
        """Watch the head while anyone waits and an installed version's head is not out yet."""
        pending = self.version < self._coming and time.monotonic() < self._woken_at + HEAD_SETTLE_S
        if self.waiters and pending and (self._settling is None or self._settling.done()):
            self._settling = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self.waiters and self.version < self._coming:
            version, _ = self._current()
            settled = time.monotonic() >= self._woken_at + HEAD_SETTLE_S
            if version > self.version and (settled or self.ready(version)):
                await self._publish(version)
            elif settled:
                return
            await asyncio.sleep(HEAD_RECHECK_S)

    async def _publish(self, version: int) -> None:
        self.version = max(self.version, version)
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def wait_newer(self, after: int, timeout: float) -> bytes | None:
        """The head once its version is above `after` (at once if it is already), else the current
        head after `timeout` s (None: this peer announces none)."""
        version, data = self._current()
        if version > after or self._changed is None or timeout <= 0:
            return data
        if version > self.version and self.ready(version):
            self.version = version  # out and ready already (nobody waited when it came)
        changed = self._changed
        self.waiters += 1
        try:
            self._settle()  # a version installed just now whose head is not out yet
            async with changed:
                await asyncio.wait_for(changed.wait_for(lambda: self.version > after), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self.waiters -= 1
        return self._current()[1]

    async def close(self) -> None:
        if self._settling is not None:
            self._settling.cancel()
            await asyncio.gather(self._settling, return_exceptions=True)

"""SIGUSR1 makes a daemon log where each of its tasks waits, and it carries on."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal

import pytest

from echo2swarm.runtime import dump

pytestmark = pytest.mark.timeout(30)


async def _stuck_on(event: asyncio.Event) -> None:
    await event.wait()


def test_listing_names_each_waiting_task_and_the_line_it_waits_on() -> None:
    async def main() -> str:
        event = asyncio.Event()
        task = asyncio.create_task(_stuck_on(event), name="stuck-one")
        await asyncio.sleep(0)
        text = dump.listing(asyncio.get_running_loop())
        event.set()
        await task
        return text

    text = asyncio.run(main())
    assert "task stuck-one: _stuck_on" in text
    assert "test_dump.py" in text and "in _stuck_on" in text
    assert "--- thread MainThread" in text


def test_sigusr1_logs_the_state_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> bool:
        loop = asyncio.get_running_loop()
        dump.install(loop)
        try:
            event = asyncio.Event()
            task = asyncio.create_task(_stuck_on(event), name="waiting-for-nobody")
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(200):  # wait (2 s at most) for the handler, which runs on a later turn of the loop
                if any("state on SIGUSR1" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.01)  # yields to the loop: the condition is checked above
            event.set()
            await task
            return task.done()
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
            faulthandler.unregister(signal.SIGUSR2)

    with caplog.at_level(logging.WARNING, logger="echo2swarm.runtime.dump"):
        assert asyncio.run(main())
    logged = [r.getMessage() for r in caplog.records if "state on SIGUSR1" in r.getMessage()]
    assert len(logged) == 1 and "task waiting-for-nobody: _stuck_on" in logged[0]

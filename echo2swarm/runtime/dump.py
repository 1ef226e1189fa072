"""What a daemon is doing right now, on SIGUSR1: every thread's stack and every asyncio task's.

A daemon that stops answering without failing (a wait nobody ends) shows where it waits only from
inside; `kill -USR1 PID` writes both listings to its log (operations.md "Inspecting a daemon")
and it carries on. The handler runs on the event loop, so a loop blocked by a callback that never
returns prints nothing: the thread listing of `faulthandler` (registered for SIGUSR2) covers that.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import signal
import sys
import threading
import traceback

from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)
MAX_FRAMES = 12  # per task: where it waits, not how it got there from the loop


def listing(loop: asyncio.AbstractEventLoop) -> str:
    """Every thread's stack, then every pending task of `loop` with the frames it is suspended in."""
    out = io.StringIO()
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        out.write(f"--- thread {names.get(ident, ident)}\n")
        out.write("".join(traceback.format_stack(frame, limit=MAX_FRAMES)))
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    out.write(f"--- {len(tasks)} asyncio tasks\n")
    for task in tasks:
        coro = task.get_coro()
        out.write(f"task {task.get_name()}: {getattr(coro, '__qualname__', coro)}\n")
        for frame in task.get_stack(limit=MAX_FRAMES):
            out.write(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
    return out.getvalue()


def install(loop: asyncio.AbstractEventLoop) -> None:
    """SIGUSR1: log `listing` at WARNING; SIGUSR2: faulthandler's thread stacks to stderr."""
    loop.add_signal_handler(signal.SIGUSR1, lambda: logger.warning("state on SIGUSR1:\n%s", listing(loop)))
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True, chain=False)

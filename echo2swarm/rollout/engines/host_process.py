"""What runs inside an engine host process: ``python -m echo2swarm.rollout.engines.host_process``.

Started by :class:`~echo2swarm.rollout.engines.host.ProcessEngine`, never by hand. It reads one
spec from the connection (engine kind, model dir, version, options, cores, log level, pacing),
pins itself, builds the engine and answers ``("ready", name)``; then it serves ``generate`` and
``load`` requests strictly in order, one reply each (``("ok", result)`` or ``("error", kind,
message)``), until ``close`` or EOF. A thread watches the lifeline pipe and exits the process the
moment the daemon's end closes. A failed request is reported and the host goes on serving.
"""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from echo2swarm.rollout.engines.host import format_cores
from echo2swarm.rollout.engines.runner import ServedEngine, describe

__all__ = ["main"]


def _watch_lifeline(fd: int) -> None:
    """Exit the moment the daemon's end of the lifeline closes: the daemon is gone, or closed us."""
    try:
        while os.read(fd, 1):
            pass
    finally:
        os._exit(0)


def _serve(conn: Connection, life_fd: int) -> int:
    spec = conn.recv()
    from echo2swarm.runtime.logging import setup_logging

    setup_logging(spec["log_level"])
    threading.Thread(target=_watch_lifeline, args=(life_fd,), name="lifeline", daemon=True).start()
    if spec["cpus"] is not None:
        try:
            os.sched_setaffinity(0, spec["cpus"])  # before torch starts its threads
        except OSError as e:
            conn.send(("error", "ValueError", f"engine.cpus {spec['cpus']}: cannot run on these cores ({e}); "
                       f"this process may use {format_cores(os.sched_getaffinity(0))}"))
            return 1
    options = dict(spec["options"])
    if spec["cpus"] is not None and options.get("threads") is None:
        options["threads"] = len(spec["cpus"])
    try:
        from echo2swarm.rollout.engines import make_engine

        engine = make_engine(spec["kind"], Path(spec["model_dir"]), **options)
    except Exception as e:  # noqa: BLE001 - reported to the daemon, which raises it
        kind, message = describe(e)
        conn.send(("error", kind if kind == "ValueError" else "RuntimeError", f"cannot build the engine: {message}"))
        return 1
    served = ServedEngine(engine, spec["version"], spec["pace"])
    conn.send(("ready", engine.name))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        op = request[0]
        if op == "close":
            break
        try:
            if op == "generate":
                result: Any = served.generate(request[1], request[2], request[3])
            elif op == "load":
                result = served.load(Path(request[1]), request[2])
            else:
                raise RuntimeError(f"unknown request {op!r}")
        except Exception as e:  # noqa: BLE001 - one failed request does not end the host
            conn.send(("error", *describe(e)))
            continue
        conn.send(("ok", result))
    served.close()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m echo2swarm.rollout.engines.host_process CONN_FD LIFELINE_FD (started by ProcessEngine)",
              file=sys.stderr)
        return 2
    return _serve(Connection(int(argv[0])), int(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

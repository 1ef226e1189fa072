"""An engine in a process of its own: the runner contract of ``runner.py`` over a socket pair.

    rollout daemon (event loop: DHT, chunk server, leases, submits)
      submit_generate(prompts, params, v) ──("generate", …)──►  engine host process, FIFO:
      submit_load(dir, v) ─────────────────("load", dir, v)──►    ServedEngine(TransformersEngine | VLLMEngine)
      reader thread: futures resolved in order ◄──("ok", …)──┘
      lifeline pipe ─────────────────────────────────────────►  EOF: the daemon is gone, exit at once

Why a process: decoding a small model, or anything on a CPU backend, is Python-bound. In a thread
of the daemon it shares the GIL (and, unpinned, the cores) with the event loop that serves weight
chunks to other peers, answers RPCs and keeps the DHT alive, and each slows the other. In a
process of its own, optionally pinned to its own cores (``engine.cpus``), the engine runs as it
does alone, and the daemon stays responsive while a long batch generates. Requests queue in the
host, so the next batch is there the moment one finishes, however late the daemon's event loop
gets to it. vLLM's engine core runs inside the host (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one
process, not two.

Weights cross as a *path*, never as tensors: the host reads the verified files itself. What runs
inside the host process is ``host_process.py``.

Failure: if the host dies (OOM, a crash in a native kernel, a kill), the requests it owed fail
with :class:`EngineProcessError` and the next request starts a new host on the newest weights
that loaded. If the daemon dies, even by SIGKILL, the host sees its lifeline close and exits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from echo2swarm.rollout.engines.base import Completion, SamplingParams
from echo2swarm.rollout.engines.runner import Batch, EngineProcessError, VersionMismatch, rebuild
from echo2swarm.runtime.devices import check_cpus, format_cores
from echo2swarm.runtime.launcher import ENV as LAUNCHER_ENV
from echo2swarm.runtime.launcher import LaunchedProcess, launch
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

__all__ = ["EngineProcessError", "ProcessEngine", "VersionMismatch"]


class _Host:
    """One engine host process and the requests it has not answered yet (oldest first)."""

    def __init__(self, proc: subprocess.Popen[bytes] | LaunchedProcess, conn: Connection, lifeline: int):
        self.proc, self.conn, self.lifeline = proc, conn, lifeline
        self.pending: deque[tuple[str, Future[Any], tuple[Any, ...]]] = deque()
        self.dead: str | None = None  # why it is unusable; set by the reader (EOF) or by close
        self._ending = threading.Lock()  # the reader thread and a caller may both end it
        self.guard = threading.Lock()  # `pending` and `dead` together: nothing is queued on a host already failed

    def alive(self) -> bool:
        return self.dead is None and self.proc.poll() is None

    def end(self, graceful_s: float = 2.0) -> int | None:
        """Close the lifeline (the host exits whatever it is doing) and reap it."""
        with self._ending:
            if self.lifeline >= 0:
                os.close(self.lifeline)
                self.lifeline = -1
        try:
            return self.proc.wait(timeout=graceful_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class ProcessEngine:
    """Runs ``make_engine(kind, model_dir, **options)`` in a child process; requests run in order.

    The runner contract of ``runner.py`` (``submit_generate``/``submit_load`` return futures, so
    the next batch can wait in the host's queue while one generates), plus the plain engine calls.

    Example::

        engine = ProcessEngine("transformers", Path("models/tiny"), version=1, cpus={1}, threads=1)
        batch = engine.submit_generate(["12+3="], SamplingParams(n=8, max_new_tokens=6), 1).result()
        seconds = engine.submit_load(Path("policy/v2"), 2).result()   # timed in the host
        engine.close()
    """

    def __init__(self, kind: str, model_dir: Path, *, version: int | None = None, cpus: set[int] | None = None,
                 pace_rollouts_per_s: float | None = None, start_timeout_s: float = 600.0,
                 log_level: str | int | None = None, **options: Any):
        """
        Args:
            kind: ``auto``, ``vllm`` or ``transformers``, resolved in the host (see ``make_engine``).
            model_dir: the first weights (an HF model directory); ``version``: their policy version.
            cpus: cores the host may run on (``sched_setaffinity``); None: the daemon's own.
            pace_rollouts_per_s: generate no faster than this (emulates a slower device).
            start_timeout_s: longest a host may take to import its library and build the engine.
            log_level: the host's logging level; None: this process's root level.
            options: passed to ``make_engine`` in the host (threads, max_batch_sequences, ...).
        """
        self.kind = kind
        self.cpus = check_cpus(sorted(cpus)) if cpus is not None else None
        self.pace = pace_rollouts_per_s
        self.start_timeout_s = start_timeout_s
        self.options = options
        self.log_level = log_level if log_level is not None else _root_level()
        self.name = kind
        self.restarts = 0  # hosts started after the first
        self.last_start_s = 0.0
        self.busy_s: dict[str, float] = {"generate": 0.0, "load": 0.0}  # seconds the hosts computed, by request
        self._weights: tuple[Path, int | None] = (Path(model_dir), version)  # what a new host loads
        self._lock = threading.Lock()  # submissions, starts and stops, in one order
        self._closed = False
        self._host: _Host | None = None
        with self._lock:
            self._start()

    @property
    def pid(self) -> int | None:
        host = self._host
        return host.proc.pid if host is not None else None

    @property
    def running(self) -> bool:
        """A host is up and not known to be dead (a request sent as it dies still fails)."""
        host = self._host
        return host is not None and host.alive()

    # ------------------------------------------------------------------ requests

    def submit_generate(self, prompts: list[str], params: SamplingParams, version: int | None) -> Future[Batch]:
        return self._submit("generate", list(prompts), params, version)

    def submit_load(self, model_dir: Path, version: int | None) -> Future[float]:
        model_dir = Path(model_dir)
        with self._lock:
            if self._host is not None and self._host.alive():
                future = self._send("load", str(model_dir), version)
                if future is not None:
                    return future
            self._restart((model_dir, version))  # a new host starts on these weights
            done: Future[float] = Future()
            done.set_result(self.last_start_s)
            return done

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        return self.submit_generate(prompts, params, None).result().groups

    def load_weights(self, model_dir: Path) -> float:
        return self.submit_load(model_dir, self._weights[1]).result()

    def close(self) -> None:
        """Stop the host at once; requests not answered yet fail with EngineProcessError."""
        with self._lock:
            self._closed = True
            self._stop("the engine was closed")

    def __del__(self) -> None:  # a forgotten engine must not leave a process behind
        try:
            self._stop("the engine was dropped")
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _submit(self, op: str, *args: Any) -> Future[Any]:
        with self._lock:
            if self._host is not None and self._host.alive():
                future = self._send(op, *args)
                if future is not None:
                    return future
            self._restart(self._weights)
            future = self._send(op, *args)
            if future is None:
                raise EngineProcessError("the engine process died as it started")
            return future

    def _send(self, op: str, *args: Any) -> Future[Any] | None:
        """Queue one request on the host (lock held); None when the host is found dead."""
        host = self._host
        assert host is not None
        future: Future[Any] = Future()
        with host.guard:
            if host.dead is not None:
                return None
            host.pending.append((op, future, args))
            try:
                host.conn.send((op, *args))
            except OSError as e:  # it died since we looked: what it owed its reader fails; this is not sent
                host.pending.pop()
                host.dead = f"the engine process is gone ({e})"
                return None
        return future

    # ------------------------------------------------------------------ the host's life (lock held)

    def _restart(self, weights: tuple[Path, int | None]) -> None:
        if self._closed:
            raise RuntimeError("ProcessEngine is closed")
        self._stop("replaced")
        self.restarts += 1
        logger.warning("starting a new engine process (restart %d) on %s", self.restarts, weights[0])
        self._weights = weights
        self._start()

    def _start(self) -> None:
        started = time.perf_counter()
        model_dir, version = self._weights
        parent, child = socket.socketpair()
        life_read, life_write = os.pipe()
        spec = {"kind": self.kind, "model_dir": str(model_dir), "version": version, "options": self.options,
                "cpus": sorted(self.cpus) if self.cpus is not None else None, "log_level": self.log_level,
                "pace": self.pace}
        try:
            proc: subprocess.Popen[bytes] | LaunchedProcess
            if os.environ.get(LAUNCHER_ENV):  # a local swarm's fork server (runtime/launcher.py)
                proc = launch(os.environ[LAUNCHER_ENV], "engine-host", ["{fd2}", "{fd3}"], dict(os.environ),
                              [1, 2, child.fileno(), life_read])
            else:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "echo2swarm.rollout.engines.host_process", str(child.fileno()), str(life_read)],
                    pass_fds=(child.fileno(), life_read), stdin=subprocess.DEVNULL,
                )
        except BaseException:
            parent.close()
            os.close(life_write)
            raise
        finally:
            child.close()
            os.close(life_read)
        host = _Host(proc, Connection(parent.detach()), life_write)
        try:
            host.conn.send(spec)
            if not host.conn.poll(self.start_timeout_s):
                raise EngineProcessError(f"the engine process did not start within {self.start_timeout_s:g} s")
            reply = host.conn.recv()
        except (EOFError, OSError) as e:
            code = host.end()
            host.conn.close()
            raise EngineProcessError(f"the engine process exited while starting (code {code}: {e})") from e
        except BaseException:
            host.end()
            host.conn.close()
            raise
        if not (isinstance(reply, tuple) and reply and reply[0] == "ready"):
            host.end()
            host.conn.close()
            if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "error":
                raise rebuild(reply[1], reply[2])
            raise EngineProcessError(f"the engine process answered {reply!r} to its start")
        self.name = reply[1]
        self._host = host
        threading.Thread(target=self._read, args=(host,), name=f"engine-{proc.pid}", daemon=True).start()
        self.last_start_s = time.perf_counter() - started
        logger.info("engine %s in process %d%s, started in %.1f s", self.name, proc.pid,
                    f" on cores {format_cores(self.cpus)}" if self.cpus else "", self.last_start_s)

    def _stop(self, why: str) -> None:
        host, self._host = self._host, None
        if host is None:
            return
        with host.guard:
            host.dead = host.dead or why
        host.end()  # its reader then reads EOF, fails what the host still owed and closes the connection

    # ------------------------------------------------------------------ replies (one thread per host)

    def _read(self, host: _Host) -> None:
        while True:
            try:
                reply = host.conn.recv()
            except (EOFError, OSError) as e:
                self._fail(host, f"{e}" or type(e).__name__)
                return
            with host.guard:
                entry = host.pending.popleft() if host.pending else None
            if entry is None:
                self._fail(host, f"it sent {reply!r} unasked")
                return
            op, future, args = entry
            if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ok":
                if op == "load":
                    self.busy_s["load"] += reply[1]
                    self._weights = (Path(args[0]), args[1])  # a restarted host starts from these
                else:
                    self.busy_s["generate"] += reply[1].busy_s
                future.set_result(reply[1])
            elif isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "error":
                future.set_exception(rebuild(reply[1], reply[2]))
            else:
                future.set_exception(EngineProcessError(f"the engine process answered {reply!r}"))

    def _fail(self, host: _Host, detail: str) -> None:
        code = host.proc.poll()
        if code is None and host.dead is None:  # it broke the protocol but still runs: end it
            code = host.end()
        with host.guard:
            why = host.dead or f"the engine process exited (code {code}; {detail})"
            host.dead = why
            owed = list(host.pending)
            host.pending.clear()
        host.conn.close()
        for _, future, _ in owed:
            future.set_exception(EngineProcessError(f"{why}; the next request starts a new one"))


def _root_level() -> str:
    import logging

    return logging.getLevelName(logging.getLogger().getEffectiveLevel())

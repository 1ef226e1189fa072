"""Verifier daemons: the learner's exact checks of older versions computed on other machines.

An exact check runs version v's forward over the rows of v's groups (train/exact.py). For a large
policy that forward needs memory the training device may not have beside the step; a verifier
daemon (`daemon --role verifier`) holds the versions as any follower does and computes the figures
instead. The learner keeps every verdict: the daemon returns measurements, not decisions.

    trainer thread ── Verifier._exact(v, rows) ─► RemoteVerifiers (here, on the learner)
        offload = never: compute here | when_full: here unless the device's free memory < the
        forward's estimate | always: ask first
        ─► rpc_check(CheckRequest) to each listed verifier in turn (the last to answer first), over the
           daemon's event loop, `remote_timeout_s` each (one that did not answer rests REST_S) ─► CheckFigures
        none answered ─► compute here (memory permitting), else the check is unavailable (counted)

    verifier daemon ── CheckServer.rpc_check (here, on the verifier)
        caller ≠ the publisher of the trusted head, or the head does not list us ─► refused `not_listed`
        version not installed ─► `not_held`;   `check.max_waiting` queued ─► `busy`
        else one forward at a time, in a thread: fp32, streamed from the version's files

Trust: the learner trusts the figures of the peer ids its operator listed (`verify.verifiers`); they
are in its signed head, so a verifier knows which learner to serve and serves no one else.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from echo2swarm.config.models import CheckConfig
from echo2swarm.config.rl import VerifyConfig
from echo2swarm.overlay.rpc import RpcError, RpcStub
from echo2swarm.runtime.devices import resolve_device
from echo2swarm.runtime.logging import get_logger
from echo2swarm.train.exact import (
    CheckUnavailable, ExactFigures, ExactSettings, exact_figures, figures_from_replies, figures_reply, request_batch,
    requests_of,
)
from echo2swarm.wire.checks import CheckFigures, CheckRefused, CheckRequest
from echo2swarm.wire.surfaces import VERIFIER_RPC

logger = get_logger(__name__)
REST_S = 60.0  # a verifier that did not answer (timeout, transport error) is not asked again for this long

__all__ = ["CheckServer", "RemoteVerifiers", "free_memory_bytes"]


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation on ``device`` (a GPU: its free memory plus what torch's cache
    holds unused; the CPU: the kernel's MemAvailable), None when it cannot be read."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        return None
    return None


class RemoteVerifiers:
    """The learner's side (`train/exact.py` `RemoteCheck`), called from the trainer's thread."""

    def __init__(self, p2p: Any, swarm: str, config: VerifyConfig, loop: asyncio.AbstractEventLoop,
                 free_bytes: Callable[[torch.device], int | None] = free_memory_bytes):
        self.config = config
        self.loop = loop
        self.free_bytes = free_bytes
        self.stubs = {peer: RpcStub(p2p, swarm, VERIFIER_RPC, peer) for peer in config.verifiers}
        self.order = list(config.verifiers)  # the last to answer first
        # asked / answered / declined_room (computed here: room enough) / no_room / none_answered /
        # refused_<reason> / failed (no answer in time, a transport error, figures that do not fit)
        self.stats: Counter[str] = Counter()
        self.by_peer: dict[str, Counter[str]] = {peer: Counter() for peer in config.verifiers}
        self.seconds = 0.0  # waiting on verifiers, summed
        self.clock = time.monotonic
        self._resting: dict[str, float] = {}  # peer -> clock() until which it is not asked (it failed to answer)

    def __call__(self, version: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 completion_mask: torch.Tensor, keys: torch.Tensor | None, settings: ExactSettings,
                 need_bytes: int) -> ExactFigures | None:
        mode = self.config.offload
        if mode == "never" or not self.stubs:
            return None
        room = True
        if mode == "when_full":
            free = self.free_bytes(input_ids.device)
            room = free is None or free >= need_bytes
            if room:
                self.stats["declined_room"] += 1
                return None
            self.stats["no_room"] += 1
        requests = requests_of(version, input_ids, attention_mask, completion_mask, keys, settings)
        self.stats["asked"] += 1
        started = time.perf_counter()
        try:
            for peer in list(self.order):
                if self._resting.get(peer, 0.0) > self.clock():
                    self.stats["skipped"] += 1  # it did not answer lately: no step waits on it again soon
                    continue
                figures = self._ask(peer, requests, completion_mask)
                if figures is not None:
                    self.order.remove(peer)
                    self.order.insert(0, peer)
                    self.stats["answered"] += 1
                    return figures
        finally:
            self.seconds += time.perf_counter() - started
        self.stats["none_answered"] += 1
        if not room:
            raise CheckUnavailable(f"no verifier answered for v{version} and the device has no room for its forward")
        return None  # `always`: compute it here

    def _ask(self, peer: str, requests: list[CheckRequest], completion_mask: torch.Tensor) -> ExactFigures | None:
        stub, counts = self.stubs[peer], self.by_peer[peer]
        timeout = self.config.remote_timeout_s
        replies: list[CheckFigures] = []
        for request in requests:
            future = asyncio.run_coroutine_threadsafe(stub.check(request, timeout=timeout), self.loop)
            try:
                reply = future.result(timeout + 5)
            except (RpcError, FutureTimeout, asyncio.TimeoutError, OSError) as e:
                future.cancel()
                self._count(counts, "failed")
                self._resting[peer] = self.clock() + REST_S
                logger.warning("verifier %s gave no figures for v%d: %s: %s", peer[-8:], request.version,
                               type(e).__name__, e)
                return None
            if isinstance(reply, CheckRefused):
                self._count(counts, f"refused_{reply.reason}")
                logger.warning("verifier %s refused v%d: %s %s", peer[-8:], request.version, reply.reason, reply.detail)
                return None
            assert isinstance(reply, CheckFigures)
            replies.append(reply)
        try:
            figures = figures_from_replies(replies, completion_mask)
        except ValueError as e:
            self._count(counts, "failed")
            logger.warning("verifier %s sent figures that do not fit: %s", peer[-8:], e)
            return None
        counts["answered"] += 1
        return figures

    def _count(self, counts: Counter[str], what: str) -> None:
        counts[what] += 1
        self.stats[what] += 1

    def snapshot(self) -> dict[str, Any]:
        return {"offload": self.config.offload, **self.stats, "wait_s": round(self.seconds, 3),
                "by_peer": {peer: dict(c) for peer, c in self.by_peer.items()}}


class CheckServer:
    """The verifier daemon's side: `rpc_check` for the learner whose trusted head lists ``own_id``.

    ``learner()`` gives the peer id of the trusted head's publisher and the verifiers it lists (None
    before a head is trusted); ``version_dir(v)`` the installed version's directory, or None."""

    def __init__(self, config: CheckConfig, own_id: str, learner: Callable[[], tuple[str, frozenset[str]] | None],
                 version_dir: Callable[[int], Path | None]):
        self.config = config
        self.own_id = own_id
        self.learner = learner
        self.version_dir = version_dir
        self.device = resolve_device(config.device, setting="check.device (--device)")
        self.stats: Counter[str] = Counter()  # served / refused_<reason> / rows / tokens
        self.compute_s = 0.0
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._skeleton: tuple[str, Any] | None = None  # (config.json sha256, StreamedPolicy)

    async def rpc_check(self, request: CheckRequest, peer: str) -> CheckFigures | CheckRefused:
        listed = self.learner()
        if listed is None or peer != listed[0] or self.own_id not in listed[1]:
            return self._refuse("not_listed", "this verifier serves only the learner whose signed head lists it")
        directory = self.version_dir(request.version)
        if directory is None:
            return self._refuse("not_held", f"v{request.version} is not installed here")
        if self._waiting > self.config.max_waiting:
            return self._refuse("busy", f"{self._waiting} checks queued")
        self._waiting += 1
        try:
            async with self._lock:
                reply = await asyncio.to_thread(self._compute, request, directory)
        finally:
            self._waiting -= 1
        if isinstance(reply, CheckRefused):
            self.stats[f"refused_{reply.reason}"] += 1
        else:
            self.stats["served"] += 1
            self.stats["rows"] += len(request.rows)
            self.stats["tokens"] += sum(len(r.ids) for r in request.rows)
            self.compute_s += reply.compute_s
        return reply

    def _refuse(self, reason: str, detail: str) -> CheckRefused:
        self.stats[f"refused_{reason}"] += 1
        return CheckRefused(reason=reason, detail=detail)  # type: ignore[arg-type]

    def _compute(self, request: CheckRequest, directory: Path) -> CheckFigures | CheckRefused:
        from echo2swarm.train.streamed import VersionWeights

        started = time.perf_counter()
        try:
            if self.config.threads:
                torch.set_num_threads(self.config.threads)
            model = self._model(directory)
            vocab = int(model.inner.config.vocab_size)
            if max(max(r.ids) for r in request.rows) >= vocab:  # checked here: on a GPU it would poison the device
                return CheckRefused(reason="failed", detail=f"a token id past the vocabulary ({vocab})")
            ids, attn, comp, keys, settings = request_batch(request, self.device)
            with model.use(VersionWeights(directory)), torch.no_grad():
                figures = exact_figures(model, ids, attn, comp, keys, settings)
            return figures_reply(request, figures, comp, time.perf_counter() - started)
        except Exception as e:  # weights that do not fit, a damaged file, ids past the vocabulary: no figures
            logger.warning("check of v%d failed: %s: %s", request.version, type(e).__name__, e)
            return CheckRefused(reason="failed", detail=f"{type(e).__name__}: {e}"[:300])

    def _model(self, directory: Path) -> Any:
        """The policy's skeleton for this version's config.json (built once per architecture): fp32,
        parameters read from the version's files during each forward."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from echo2swarm.train.streamed import StreamedPolicy, buffers_to, parameters_on_meta

        digest = hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()
        if self._skeleton is None or self._skeleton[0] != digest:
            with parameters_on_meta():
                skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
            self._skeleton = (digest, StreamedPolicy(buffers_to(skeleton, self.device), device=self.device))
        return self._skeleton[1]

    def snapshot(self) -> dict[str, Any]:
        return {**self.stats, "compute_s": round(self.compute_s, 3), "waiting": self._waiting,
                "device": str(self.device)}

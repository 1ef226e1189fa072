"""A rogue rollout worker: joins the swarm's DHT, announces a card and speaks the lease/submit RPCs.

It uses the same records, wire messages and RPC framing as an honest worker (anyone can, from
protocol.md), but runs no model: what it submits is whatever a test tells it to craft.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from echo2swarm.overlay.rpc import RpcStub
from echo2swarm.wire.surfaces import LEARNER_RPC
from echo2swarm.wire.work import (
    CompletionMsg,
    GroupSubmission,
    Lease,
    LeasePrompt,
    LeaseRequest,
    LeaseWait,
    SubmitResult,
)

Craft = Callable[[LeasePrompt, int], list[CompletionMsg]]  # (prompt, group size) -> completions


class RogueWorker:
    def __init__(self, bootstrap: str, swarm: str, learner: str):
        self.bootstrap, self.swarm, self.learner = bootstrap, swarm, learner
        self.overlay: Any = None
        self.p2p: Any = None
        self.peer_id = ""
        self.stub: Any = None  # the learner's surface, as an honest worker calls it

    async def __aenter__(self) -> "RogueWorker":
        from echo2swarm.config.models import OverlayConfig
        from echo2swarm.overlay.node import Overlay

        config = OverlayConfig(swarm=self.swarm, initial_peers=[self.bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.overlay = await Overlay.start(config)
        self.p2p = self.overlay.p2p
        self.peer_id = self.overlay.peer_id
        self.stub = RpcStub(self.p2p, self.swarm, LEARNER_RPC, self.learner)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.overlay.stop()

    async def announce(self, price: float = 0.0, rollouts_per_s: float = 1e6) -> bool:
        """A card as any rollout peer's, claiming whatever the test says (signed: it is our own)."""
        import time

        from echo2swarm.wire.records import PeerCard

        card = PeerCard(peer_id=self.peer_id, role="rollout", price=price, state="ready", software="0.1.0",
                        rollouts_per_s=rollouts_per_s, updated_ms=int(time.time() * 1000))
        return bool(await self.overlay.store_card(card))

    async def lease(self, max_prompts: int = 8, held_version: int | None = None) -> Lease | LeaseWait:
        request = LeaseRequest(max_prompts=max_prompts, held_version=held_version)
        reply = await self.stub.lease(request, timeout=10)
        assert isinstance(reply, (Lease, LeaseWait))
        return reply

    async def submit(self, lease: Lease, version: int, craft: Craft) -> SubmitResult:
        # Claims the lease's seeded sampler, as any worker may: the intake takes the claim, verification tests it.
        groups = [GroupSubmission(lease_id=lease.lease_id, prompt_id=p.prompt_id, version=version, generation_s=0.1,
                                  completions=craft(p, lease.sampling.n), sampler=lease.sampling.sampler)
                  for p in lease.prompts]
        result = await self.stub.submit(groups, timeout=10)
        assert isinstance(result, SubmitResult)
        return result

    async def lease_until_granted(self, timeout: float, held_version: int | None = None) -> Lease | LeaseWait:
        """Ask until a lease comes (or the learner says done); the last reply either way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            reply = await self.lease(held_version=held_version)
            if isinstance(reply, Lease) or reply.done or loop.time() > deadline:
                return reply
            await asyncio.sleep(min(reply.retry_s, 0.5))  # poll interval: the learner's own back-off


def right_answer_ids(model_dir: Any) -> Callable[[LeasePrompt], list[int]]:
    """token ids of the right answer to an arith prompt, ended by EOS, from the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def ids(prompt: LeasePrompt) -> list[int]:
        a, b = prompt.text.rstrip("=").split("+")
        return tokenizer(str(int(a) + int(b)), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    return ids


PACED = {"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "40", "ECHO2SWARM_ENGINE__THREADS": "1"}


def training_swarm(swarm: Any, model: Any, key: Any, tmp_path: Any, steps_first: int = 3,
                   env: dict[str, str] | None = None) -> tuple[Any, Any, str, Any]:
    """A bootstrap, a learner (400 steps, `env` for its settings) and one paced honest rollout peer,
    trained for `steps_first` steps. Returns (learner, honest peer, learner /v1/info URL, metrics path)."""
    from pathlib import Path

    from helpers.swarm import learner_toml, read_metrics, wait_until

    config = learner_toml(tmp_path / "learner.toml", model, key, steps=400)
    swarm.bootstrap()
    learner = swarm.start("learner", "--config", str(config), env=env)
    honest = swarm.rollout("rollout-1", trust=Path(f"{key}.pub"), env=PACED)
    swarm.ready(learner)
    swarm.ready(honest)
    metrics = learner.state_dir / "run" / "metrics.jsonl"
    wait_until(lambda: len(read_metrics(metrics)) >= steps_first, 120, what="the learner training on the honest peer")
    return learner, honest, learner.info["chunk_url"] + "/v1/info", metrics


async def drip(request: Any, body: bytes, every_s: float, for_s: float = 120.0) -> Any:
    """Answer an aiohttp request with `body`'s honest Content-Length at once, then one byte of it every
    `every_s` seconds: never a stall, always far below any minimum rate. Bounded (`for_s`): a fetcher
    that never gives up is cut there. Ends quietly when the fetcher hangs up or the handler is cancelled."""
    from aiohttp import web

    resp = web.StreamResponse(headers={"Content-Length": str(len(body))})
    await resp.prepare(request)
    try:
        for i in range(int(for_s / every_s)):
            await resp.write(body[i : i + 1])
            await asyncio.sleep(every_s)  # the attack itself: the drip
    except (ConnectionError, asyncio.CancelledError):
        pass
    return resp

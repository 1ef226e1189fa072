"""Fresh identities against the learner's work: they must never cost it what delivering peers give it.

One training swarm (a learner with a step time that makes two paced honest peers just meet the
activation floor, so a cheaper planned peer would put them on standby), two attacks with fresh
Ed25519 keys and properly signed cards, each measured against the step rate before it:
  1. a burst: five keys at price 0 each deliver one fast group, then idle with their cards alive;
  2. a crowd: a hundred keys each take what a newcomer is given and never deliver, asking again
     whenever they hold nothing, cards alive.
The learner keeps at least half its step rate under each, and no delivering peer is on standby
longer than one re-plan period in favour of a fresh identity. The identities' libp2p hosts start
before the first measurement: on this one machine their hundred p2pd processes take CPU from the
learner and the honest peers even while idle (the step rate before is then about half what it is
without them), and a window with their start-up storm in it measured the harness, not the attack.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from helpers.rogue import PACED, right_answer_ids
from helpers.swarm import LocalSwarm, http_json, learner_toml, stalled_report, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(420)]

REPLAN_S = 2.0
CROWD = 100
BURST = 5
WINDOW_S = 6.0  # each measurement: the steps the learner makes in this many seconds (~10 at ~1.7 steps/s)


class StepRate:
    """Learner steps per second over a window, read from its /v1/info; and, sampled meanwhile, the
    longest stretch during which a fresh identity was in the plan's active set while an honest,
    delivering peer was on standby (the plan may legitimately keep an honest peer idle when the
    other one meets the floor alone: that is not the attack)."""

    def __init__(self, info_url: str, honest: set[str]):
        self.info_url, self.honest = info_url, honest
        self.displaced_s = 0.0

    def measure(self, seconds: float, strangers: set[str] = frozenset()) -> float:
        since: float | None = None
        first = self._stats()
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            stats = self._stats()
            now = time.monotonic()
            plan = stats["capacity"]["plan"] if stats["capacity"]["planned"] else {}
            displaced = set(plan.get("standby", ())) & self.honest and set(plan.get("active", ())) & strangers
            if displaced:
                since = now if since is None else since
                self.displaced_s = max(self.displaced_s, now - since)
            else:
                since = None
            time.sleep(0.25)  # poll interval of the sampler
        last = self._stats()
        return (last["steps_done"] - first["steps_done"]) / (time.monotonic() - started)

    def _stats(self) -> dict[str, Any]:
        return http_json(self.info_url)["stats"]


class Crowd:
    """Fresh identities, each its own libp2p host (an authenticated peer id), with signed cards kept
    alive in the DHT through one client, all on an event loop in a thread of their own."""

    def __init__(self, bootstrap: str, learner: str, learner_id: str, swarm: str):
        self.bootstrap, self.learner, self.learner_id, self.swarm = bootstrap, learner, learner_id, swarm
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dir = Path(tempfile.mkdtemp(prefix="e2s-sybils-"))
        self.hosts: list[Any] = []
        self.keys: list[Any] = []
        self.node: Any = None
        self.stop = asyncio.Event()
        self.tasks: list[Any] = []
        self.stats = {"leases": 0, "waits": 0, "submitted": 0}
        self.taken = 0
        self.starting: Any = None

    def run(self, coro: Any, timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, n: int) -> None:
        from hivemind.dht.node import DHTNode
        from hivemind.p2p import P2P

        from echo2swarm.overlay.validation import SwarmRecordValidator
        from echo2swarm.wire.peer_keys import PeerKey

        if self.node is None:
            p2p = await P2P.create(initial_peers=[self.bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            self.node = await DHTNode.create(p2p=p2p, initial_peers=[self.bootstrap], client_mode=True,
                                             record_validator=SwarmRecordValidator(self.swarm))
            self.node_p2p = p2p

        async def one() -> tuple[Any, Any]:
            key = PeerKey.generate()
            path = self.dir / f"{key.peer_id}.key"
            key.save(path)
            host = await P2P.create(identity_path=str(path), initial_peers=[self.learner], host_maddrs=[],
                                    check_if_identity_free=False, no_listen=True, startup_timeout=120)
            return key, host

        for start in range(0, n, 10):  # p2pd starts are CPU-bound: a few at a time
            for key, host in await asyncio.gather(*(one() for _ in range(min(10, n - start)))):
                self.keys.append(key)
                self.hosts.append(host)

    async def _cards(self, keys: list[Any]) -> int:
        from echo2swarm.overlay.dht_keys import peers_key
        from echo2swarm.wire.records import PeerCard

        async def store(key: Any) -> bool:
            card = PeerCard(peer_id=key.peer_id, role="rollout", price=0.0, state="ready", software="0.1.0",
                            rollouts_per_s=1e6, updated_ms=int(time.time() * 1000)).signed(key, self.swarm, 120.0)
            return bool(await self.node.store(peers_key(self.swarm), card.model_dump(mode="json"),
                                              time.time() + 120.0, subkey=key.peer_id))

        return sum(await asyncio.gather(*(store(k) for k in keys)))

    def stub(self, host: Any) -> Any:
        from echo2swarm.overlay.rpc import RpcStub
        from echo2swarm.wire.surfaces import LEARNER_RPC

        return RpcStub(host, self.swarm, LEARNER_RPC, self.learner_id)

    async def _hoard(self, host: Any) -> None:
        """Take what a newcomer is given, never deliver; ask again whenever nothing is held."""
        from echo2swarm.overlay.rpc import RpcError
        from echo2swarm.wire.work import Lease, LeaseRequest

        held_until = 0.0
        stub = self.stub(host)
        while not self.stop.is_set():
            if time.monotonic() >= held_until:
                try:
                    reply = await stub.lease(LeaseRequest(max_prompts=8, held_version=None), timeout=10)
                except RpcError:
                    reply = None
                if isinstance(reply, Lease):
                    self.stats["leases"] += 1
                    held_until = time.monotonic() + reply.deadline_s
                elif reply is not None:
                    self.stats["waits"] += 1
                    if reply.done:
                        return  # banned
            try:
                await asyncio.wait_for(self.stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    async def _burst(self, host: Any, answer: Any) -> None:
        """One lease; one group of it delivered at once with the right answers (logprobs made up), then nothing."""
        from echo2swarm.wire.work import CompletionMsg, GroupSubmission, Lease, LeaseRequest

        stub = self.stub(host)
        for _ in range(40):
            reply = await stub.lease(LeaseRequest(max_prompts=8, held_version=None), timeout=10)
            if isinstance(reply, Lease):
                break
            await asyncio.sleep(min(reply.retry_s, 0.5))  # poll interval: the learner's own back-off
        else:
            return
        head_version = reply.min_version
        p = reply.prompts[0]  # one group: a single refusal is no ban, and the rate it shows is a burst's
        groups = [GroupSubmission(
            lease_id=reply.lease_id, prompt_id=p.prompt_id, version=head_version, generation_s=0.01,
            sampler=reply.sampling.sampler,
            completions=[CompletionMsg(token_ids=answer(p), logprobs=[-0.05] * len(answer(p)), finish_reason="stop")
                         for _ in range(reply.sampling.n)])]
        result = await stub.submit(groups, timeout=10)
        self.stats["submitted"] += result.accepted

    def prepare(self, n: int) -> Any:
        """Start `n` identities' hosts ahead of the measurements (their p2pd starts are this machine's
        cost of playing the attacker, not the learner's); returns the future of their start."""
        self.starting = asyncio.run_coroutine_threadsafe(self._start(n), self.loop)
        return self.starting

    def _take(self, n: int) -> tuple[list[Any], list[Any]]:
        """The next `n` prepared identities."""
        keys, hosts = self.keys[self.taken:self.taken + n], self.hosts[self.taken:self.taken + n]
        assert len(hosts) == n, f"{n} identities asked, {len(hosts)} prepared and not taken"
        self.taken += n
        return keys, hosts

    def burst(self, n: int, answer: Any) -> None:
        keys, hosts = self._take(n)
        assert self.run(self._cards(keys)) >= n - 1

        async def deliver() -> None:
            await asyncio.wait_for(asyncio.gather(*(self._burst(h, answer) for h in hosts)), 120)

        self.run(deliver())

    def crowd(self, n: int) -> None:
        keys, hosts = self._take(n)
        assert self.run(self._cards(keys)) >= n * 0.9

        async def spawn() -> None:
            self.tasks += [asyncio.ensure_future(self._hoard(h)) for h in hosts]

        self.run(spawn())

    def close(self) -> None:
        async def shutdown() -> None:
            self.stop.set()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await asyncio.gather(*(h.shutdown() for h in self.hosts), return_exceptions=True)
            if self.node is not None:
                await self.node.shutdown()
                await self.node_p2p.shutdown()

        try:
            if self.starting is not None:  # hosts still starting would outlive the shutdown below
                try:
                    self.starting.result(120)
                except Exception:  # the test already fails for what it raised
                    pass
            self.run(shutdown(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            shutil.rmtree(self.dir, ignore_errors=True)


def test_fresh_identities_never_cost_the_learner_its_delivering_peers(
    local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
) -> None:
    # A step takes >= 0.5 s, so the floor is ~1.1 * 32 rollouts / 0.5 s = 70/s: both honest peers (40/s
    # each) are needed, and a planned peer claiming more at price 0 would put them on standby.
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=2000, min_step_s=0.5,
                          sections={"activation": {"replan_period_s": REPLAN_S}})
    swarm = local_swarm
    swarm.bootstrap()
    learner = swarm.start("learner", "--config", str(config))
    honest = [swarm.rollout(f"rollout-{i}", price=0.3 + 0.1 * i, trust=Path(f"{policy_key}.pub"), env=PACED)
              for i in range(2)]
    info = swarm.ready(learner)
    info_url = info["chunk_url"] + "/v1/info"
    crowd = Crowd(swarm.bootstrap_addr, learner.maddr, info["peer_id"], swarm.swarm)
    try:
        starting = crowd.prepare(BURST + CROWD)  # beside the honest peers' own start, before any measurement
        for peer in honest:
            swarm.ready(peer)
        rate = StepRate(info_url, {p.info["peer_id"] for p in honest})
        wait_until(lambda: http_json(info_url)["stats"]["capacity"]["planned"], 180, interval=0.5,
                   what="the learner's first activation plan over the two honest peers")
        starting.result(300)
        # The hosts' start-up storm can starve the learner long enough that its planned peer looks quiet
        # and leaves the plan (CI, stop 37: no step for 40 s). Measure from a swarm that recovered from
        # the harness: steps flowing again under a plan, as before the storm.
        recovered_from = http_json(info_url)["stats"]["steps_done"]

        def recovered() -> bool:
            stats = http_json(info_url)["stats"]
            return stats["steps_done"] >= recovered_from + 5 and stats["capacity"]["planned"]

        try:
            wait_until(recovered, 180, interval=0.5, what="the learner to step under a plan again after the hosts started")
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{stalled_report(info_url, learner, honest)}") from e
        before = rate.measure(WINDOW_S)
        assert before > 0.3, before
        crowd.burst(BURST, right_answer_ids(tiny_model_dir))
        during_burst = rate.measure(WINDOW_S, {k.peer_id for k in crowd.keys})
        crowd.crowd(CROWD)
        try:
            wait_until(lambda: crowd.stats["leases"] + crowd.stats["waits"] >= CROWD, 180, interval=0.5,
                       what="every sybil to have asked for work")
        except TimeoutError as e:
            raise AssertionError(f"{e}: crowd {crowd.stats}\n{stalled_report(info_url, learner, honest)}") from e
        during_crowd = rate.measure(WINDOW_S, {k.peer_id for k in crowd.keys})
    finally:
        crowd.close()
    stats = http_json(info_url)["stats"]
    print(f"step rate before {before:.2f}/s, burst {during_burst:.2f}/s ({during_burst / before:.2f}x), crowd "
          f"{during_crowd:.2f}/s ({during_crowd / before:.2f}x); honest displaced {rate.displaced_s:.1f} s; crowd {crowd.stats}; "
          f"peers {stats['peers']}")
    assert crowd.stats["submitted"] >= 1  # the burst delivered
    assert during_burst >= 0.5 * before, (before, during_burst)
    assert during_crowd >= 0.5 * before, (before, during_crowd)
    assert rate.displaced_s <= REPLAN_S + 1.0, rate.displaced_s
    assert stats["peers"].get("newcomer_pool_full", 0) > 0  # the crowd met the newcomers' pool

"""The learner's data intake: serves `rpc_lease` and `rpc_submit` for rollout peers.

    rpc_lease ─► banned? ─► standby? ─► the peer's allowance (PeerLedger) ─► budget check
                  ─► LeaseManager.issue ─► Lease (prompts, sampling, min version, signed head)
    rpc_submit ─► per group: banned? lease owner? open prompt? version in window? shapes? decodes?
                  ─► reward by the task (ground truth stays here) ─► RolloutBuffer ─► wake the trainer

Accountability (learner/accountability.py): a refusal an honest peer never causes is a strike, a
lease that lapses undelivered is one too, and the learner's verification of trained groups adds its
own (`strike`); past a threshold the peer is banned for the run: its open leases are re-issued,
its buffered groups dropped (counted as `banned`), and every later request or group refused.

Activation: the `WorkGate` it is built with (the learner's cost-aware plan) may answer that a peer
is on standby; it then gets `LeaseWait(standby=True)` and no work. Each completed submission
reports the peer's delivered rollouts, the seconds it spent on them and the lease's latency to the
gate's `on_delivery`, which the plan measures µ and L_gen by.

Back-pressure: groups open in leases plus groups in the buffer's staleness window never exceed
the in-flight cap: R + headroom · R · W / T_train groups (what keeps the learner busy while a
lease is generated, W the peers' work time per lease, measured by the gate; `train.inflight_headroom`), and never more than (S + 1) · R, so
peers cannot pile up work that will only go stale and staleness stays well below S; beyond that
a peer is told to wait (`LeaseWait`) and asks again shortly. A peer may ask to be held
(`LeaseRequest.wait_s`, long polling): its request then waits, up to `leases.max_hold_s`, until
a training step, a publish or an expired lease frees work (`work_freed`), and is answered the
moment there is some, instead of the peer polling. A peer holding an older version
gets only as much work as the steps left in that version's window can still consume (oldest
groups train first), and is told to fetch the newer version for the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from echo2swarm.config.rl import LeaseConfig, PeersConfig, TrainConfig
from echo2swarm.learner.accountability import VIOLATIONS, Ban, PeerLedger
from echo2swarm.learner.activation_loop import Activity
from echo2swarm.learner.buffer import RolloutBuffer
from echo2swarm.train.group import Group
from echo2swarm.learner.leases import RELEASED, GroupLimits, LeaseManager, check_group
from echo2swarm.wire.work import GroupSubmission, Lease, LeaseRequest, LeaseWait, LeasePrompt, SamplingSpec, SubmitResult
from echo2swarm.overlay.rpc import RpcError
from echo2swarm.runtime.aio import wait_any
from echo2swarm.runtime.logging import get_logger
from echo2swarm.tasks.base import Task
from echo2swarm.wire.sampling import SAMPLER

logger = get_logger(__name__)


class WorkGate(Protocol):
    """Who may work (cost-aware activation), and where delivered work is reported to."""

    standby_retry_s: float  # how long a peer on standby waits before asking again

    def gate(self, peer: str) -> str | None:
        """Why `peer` is on standby, or None when it may work."""

    def on_delivery(self, peer: str, rollouts: int, seconds: float, latency: float | None = None) -> None:
        """`peer` delivered `rollouts` it spent `seconds` on, `latency` s after the lease was issued."""

    def on_lapse(self, peer: str) -> None:
        """A lease of `peer` lapsed with nothing delivered."""

    def inflight_target(self, groups_per_step: int, headroom: float) -> int | None:
        """Groups to keep leased or buffered so the learner never waits, from measured lease latency
        and step time; None until both are measured."""


class Intake:
    def __init__(
        self,
        task: Task,
        train: TrainConfig,
        leases_config: LeaseConfig,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        limits: GroupLimits,
        version: int,
        cursor: int = 0,
        requeue: list[int] | None = None,
        gate: WorkGate | None = None,
        head_json: str | None = None,
        ledger: PeerLedger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.task = task
        self.train = train
        self.leases_config = leases_config
        self.encode = encode
        self.decode = decode
        self.limits = limits
        self.clock = clock
        self.version = version            # the step about to train = newest acceptable version
        self.published_version = version  # what peers can fetch
        self.head_json = head_json        # the signed head of published_version, handed out with every reply
        self.done = False
        self.leases = LeaseManager(leases_config.timeout_s, leases_config.max_prompts, cursor, requeue or [])
        self.buffer = RolloutBuffer(train.staleness, order=train.schedule)
        self.wake = asyncio.Event()  # a group arrived: the trainer may have its batch
        self._freed = asyncio.Event()  # work was freed: held lease requests look again (replaced on each pulse)
        self.accepted = 0
        self.refused: Counter[str] = Counter()
        self.delivered: Counter[str] = Counter()  # accepted groups per peer id
        self.gate = gate
        self.ledger = ledger if ledger is not None else PeerLedger(PeersConfig())
        self._delivered_at: dict[str, float] = {}  # peer -> clock of its last reported delivery
        self._carried: dict[str, int] = {}  # peer -> rollouts waiting to be reported with the next delivery
        self.seen: OrderedDict[str, float] = OrderedDict()  # peer -> last lease request (clock), newest last
        self._held: Counter[str] = Counter()  # peer -> lease requests held now

    # -- what the learner tells it -------------------------------------------------------------
    def published(self, version: int, head_json: str | None) -> None:
        """`version` is out, with its signed head: peers held for want of it can have work now."""
        self.published_version = version
        self.head_json = head_json
        self.work_freed()

    def advance(self, version: int) -> None:
        """A step took its batch: new work serves the step training `version` next."""
        self.version = version
        self.work_freed()

    def finish(self) -> None:
        """Training is over: every request is answered `done`."""
        self.done = True
        self.work_freed()

    def expire_leases(self) -> bool:
        """Re-issue the prompts of lapsed leases; each lapse counts against its peer. True if any lapsed."""
        expired = self.leases.expire(self.clock())
        for lease in expired:
            if self.gate is not None:
                self.gate.on_lapse(lease.peer_id)
            ban = self.ledger.lapsed(lease.peer_id, self.clock())
            if ban is not None:
                self._banned(lease.peer_id, ban)
        if expired:
            self.work_freed()
        return bool(expired)

    def strike(self, peer: str, reason: str, conclusive: bool = False) -> None:
        """`peer` sent something an honest peer never sends (here, or found by the trainer's verification);
        ``conclusive``: ban it at once (PeerLedger.strike)."""
        ban = self.ledger.strike(peer, reason, self.clock(), conclusive=conclusive)
        if ban is not None:
            self._banned(peer, ban)

    def _banned(self, peer: str, ban: Ban) -> None:
        revoked = self.leases.drop_peer(peer)
        dropped = self.buffer.drop_peer(peer)
        self.reissue(dropped)
        logger.warning("peer %s banned (%s): %d open prompts re-issued, %d buffered groups dropped and their "
                       "prompts re-issued", peer, ban.reason, revoked, len(dropped))
        self.work_freed()

    def reissue(self, groups: list[Group]) -> None:
        """Thrown-away groups (a banned peer's, or refused by verification): their prompts go to others,
        never back to the peer whose group was thrown away."""
        for g in groups:
            if g.prompt_index is not None:
                self.leases.put_back([g.prompt_index], not_to=g.peer_id)
                self.leases.stats["reissued_after_refusal"] += 1

    def verified(self, groups: list[Group]) -> None:
        """These groups passed the trainer's verification: their peers' verified work (graduation)."""
        for peer, n in Counter(g.peer_id for g in groups).items():
            self.ledger.verified(peer, n)

    def activity(self) -> dict[str, Activity]:
        """What each peer that asked for work lately did: its last request and its oldest open lease
        (what activation judges a planned peer's quietness by); banned peers left out."""
        oldest: dict[str, float] = {}
        for lease in self.leases.open.values():
            oldest[lease.peer_id] = min(lease.issued_at, oldest.get(lease.peer_id, lease.issued_at))
        return {peer: Activity(last_request=at, oldest_open=oldest.get(peer))
                for peer, at in self.seen.items() if peer not in self.ledger.bans}

    @property
    def newcomer_capacity(self) -> int:
        """Prompts all peers on probation may hold together (peers.newcomer_prompts, default R)."""
        return self.ledger.config.newcomer_prompts or self.train.prompts_per_step

    @property
    def capacity(self) -> int:
        """Groups leased or in the buffer's window at most: the in-flight target, capped by (S + 1) · R."""
        bound = (self.train.staleness + 1) * self.train.prompts_per_step
        if self.gate is None:
            return bound
        target = self.gate.inflight_target(self.train.prompts_per_step, self.train.inflight_headroom)
        return bound if target is None else max(self.train.prompts_per_step, min(bound, target))

    def budget(self, held_version: int | None = None, newcomer: bool = False) -> int:
        """Prompts a lease may take now: from the in-flight budget, or, for a peer on probation, from the
        newcomers' pool, which is outside it (what newcomers hold never keeps work from graduated peers)."""
        committed = self.leases.open_prompts(newcomer=False) + self.buffer.count_usable(self.version)
        budget = self.capacity - committed
        if newcomer:
            budget = self.newcomer_capacity - self.leases.open_prompts(newcomer=True)
            committed += self.leases.open_prompts(newcomer=True)  # what trains first, for the window below
        if held_version is not None and held_version < self.version:
            # Groups of version h can train steps up to h + S; the committed ones train first. While a
            # step trains, `version` is already the next step, so a peer holding even the newest
            # published version has one step fewer left than a full window: lease only that much.
            steps_left = held_version + self.train.staleness - self.version + 1
            budget = min(budget, steps_left * self.train.prompts_per_step - committed)
        return budget

    def _refuse(self, reason: str, peer: str, detail: str = "") -> None:
        self.refused[reason] += 1
        logger.debug("refused group from %s: %s %s", peer[-8:], reason, detail)

    def work_freed(self) -> None:
        """Budget may have grown (a step took its batch, a version was published, leases expired)."""
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()  # wakes every request held on it; later ones wait on the new event

    async def rpc_lease(self, request: LeaseRequest, peer: str) -> Lease | LeaseWait:
        loop = asyncio.get_running_loop()
        since = loop.time()
        until = since + min(request.wait_s, self.leases_config.max_hold_s)
        # A peer has no use for more held requests than leases it may hold: the rest are answered at once.
        if self._held[peer] >= self.ledger.config.max_open_leases:
            until = since
            self.ledger.stats["held_requests_refused"] += 1
        while True:
            freed = self._freed
            reply = self._answer(request, peer)
            left = until - loop.time()
            # Held only while the learner itself has no work: a peer told to fetch a newer version
            # first is answered at once (its next request will carry the version it then holds).
            if isinstance(reply, Lease) or reply.standby or reply.done or reply.fetch_first or reply.capped or left <= 0:
                return reply.model_copy(update={"held_s": min(60.0, loop.time() - since)})
            self._held[peer] += 1
            try:
                await wait_any(freed, timeout=left)
            finally:
                self._held[peer] -= 1
                if not self._held[peer]:
                    del self._held[peer]

    def _answer(self, request: LeaseRequest, peer: str) -> Lease | LeaseWait:
        if self.done:
            return LeaseWait(retry_s=5.0, reason="training finished", done=True, head=self.head_json)
        self.expire_leases()
        ban = self.ledger.banned(peer)
        if ban is not None:
            return LeaseWait(retry_s=60.0, reason=f"banned for this run: {ban.reason}"[:200], done=True)
        self.seen[peer] = self.clock()
        self.seen.move_to_end(peer)
        while len(self.seen) > self.ledger.config.max_tracked_peers:  # a flood of fresh peer ids
            self.seen.popitem(last=False)
        standby = self.gate.gate(peer) if self.gate is not None else None
        if standby is not None:
            return LeaseWait(retry_s=self.gate.standby_retry_s, reason=f"standby: {standby}"[:200], standby=True,
                             head=self.head_json)
        allowed = self.ledger.allowance(peer, request.max_prompts, self.leases.open_leases_of(peer), self.clock())
        if allowed <= 0:
            why = "deliver the work you hold first" + (" (probation)" if self.ledger.on_probation(peer) else "")
            return LeaseWait(retry_s=self.ledger.config.capped_retry_s, reason=why, head=self.head_json, capped=True)
        min_version = max(1, self.version - self.train.staleness)
        min_version = min(min_version, self.published_version)
        newcomer = self.ledger.on_probation(peer)
        lease = self.leases.issue(
            peer, allowed, budget=self.budget(request.held_version, newcomer=newcomer), min_version=min_version,
            now=self.clock(), prompt_id_of=lambda i: self.task.prompt(i).prompt_id, newcomer=newcomer,
        )
        if lease is not None:
            self.ledger.issued(peer, len(lease.prompts), self.clock())
        if lease is None:
            stale = request.held_version is not None and request.held_version < self.published_version
            if newcomer and not stale:
                self.ledger.stats["newcomer_pool_full"] += 1
            reason = (f"fetch v{self.published_version} first" if stale
                      else "newcomers' share of the work is taken (probation)" if newcomer else "enough work in flight")
            return LeaseWait(retry_s=self.leases_config.wait_retry_s, reason=reason, head=self.head_json,
                             fetch_first=stale)
        return Lease(
            lease_id=lease.lease_id,
            prompts=[LeasePrompt(prompt_id=pid, text=self.task.prompt(i).text) for pid, i in lease.prompts.items()],
            sampling=SamplingSpec(
                n=self.train.group_size, max_new_tokens=self.train.max_new_tokens, temperature=self.train.temperature,
                top_p=self.train.top_p, seed=lease.seed, sampler=SAMPLER,
            ),
            min_version=lease.min_version,
            deadline_s=self.leases_config.timeout_s,
            head=self.head_json,
        )

    def accept(self, sub: GroupSubmission, peer: str,
               tally: dict[str, tuple[float, int]] | None = None) -> str | None:
        """Check one group and, if acceptable, reward it and buffer it. Returns the refusal reason.

        `tally` collects lease id -> (issued at, rollouts accepted) for the delivery measurement.
        """
        reason = "banned" if self.ledger.banned(peer) is not None else self.leases.check(peer, sub.lease_id, sub.prompt_id)
        if reason is None:
            reason = check_group(sub, self.limits, current_version=self.version, staleness=self.train.staleness,
                                 newest_published=self.published_version)
        texts: list[str] = []
        if reason is None:
            try:
                texts = [self.decode(c.token_ids) for c in sub.completions]
            except Exception:  # a tokenizer that cannot decode these ids
                reason = "undecodable"
            # A replacement character means bytes that are no text, except at the very end of a
            # completion cut by max_new_tokens, which may stop inside a multi-byte character.
            if reason is None and any(
                "\ufffd" in (t.rstrip("\ufffd") if c.finish_reason == "length" else t)
                for t, c in zip(texts, sub.completions)
            ):
                reason = "undecodable"
        if reason is not None:
            self._refuse(reason, peer, sub.prompt_id)
            if reason in VIOLATIONS:
                self.strike(peer, reason)
            elif reason in RELEASED:  # no lie, no use: its prompt goes to whoever can use it now, no lapse
                self.leases.release(sub.lease_id, sub.prompt_id)
                self.work_freed()
            return reason
        issued_at, seed = self.leases.open[sub.lease_id].issued_at, self.leases.open[sub.lease_id].seed
        index = self.leases.complete(sub.lease_id, sub.prompt_id)
        if tally is not None:
            tally[sub.lease_id] = (issued_at, tally.get(sub.lease_id, (0.0, 0))[1] + len(sub.completions))
        prompt = self.task.prompt(index)
        rewards = [
            float(self.task.reward(prompt.prompt_id, text, c.finish_reason == "stop"))
            for text, c in zip(texts, sub.completions)
        ]
        self.buffer.add(Group(
            prompt_id=prompt.prompt_id,
            version=sub.version,
            prompt_ids=self.encode(prompt.text),
            completions=[list(c.token_ids) for c in sub.completions],
            behaviour_logprobs=[list(c.logprobs) for c in sub.completions],
            rewards=rewards,
            finish_reasons=[c.finish_reason for c in sub.completions],
            peer_id=peer,
            received_at=self.clock(),
            prompt_index=index,
            sampler=SAMPLER if sub.sampler == SAMPLER else None,
            seed=seed if sub.sampler == SAMPLER else None,
        ))
        self.accepted += 1
        self.delivered[peer] += 1
        self.ledger.delivered(peer, 1, self.clock())
        self.wake.set()
        return None

    def _report_delivery(self, peer: str, tally: dict[str, tuple[float, int]]) -> None:
        assert self.gate is not None
        """µ from the seconds this peer spent on the lease, L_gen from issue to delivery.

        A peer that works ahead (prefetched leases) holds a lease while it finishes the one before:
        its issue-to-delivery time is longer than the work. So a µ sample covers the time since the
        later of the lease's issue and the peer's previous delivery; two submissions landing
        together are counted as one.
        """
        now = self.clock()
        for issued_at, rollouts in tally.values():
            since = max(issued_at, self._delivered_at.get(peer, issued_at))
            rollouts += self._carried.pop(peer, 0)
            if now - since < 0.01:
                self._carried[peer] = rollouts
                continue
            self.gate.on_delivery(peer, rollouts, now - since, now - issued_at)
            self._delivered_at[peer] = now

    async def rpc_submit(self, messages: AsyncIterator[GroupSubmission | RpcError], peer: str) -> SubmitResult:
        accepted, refused = 0, Counter()
        tally: dict[str, tuple[float, int]] = {}
        async for message in messages:
            if isinstance(message, RpcError):
                self._refuse("malformed", peer, str(message))
                self.strike(peer, "malformed")
                refused["malformed"] += 1
                continue
            reason = self.accept(message, peer, tally)
            if reason is None:
                accepted += 1
            else:
                refused[reason] += 1
        if self.gate is not None:
            self._report_delivery(peer, tally)
        return SubmitResult(accepted=accepted, refused=dict(refused))

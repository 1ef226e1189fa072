"""Per-peer caps and bans (learner/accountability.py), alone and through the learner's intake."""

from __future__ import annotations

import asyncio

from helpers.intake import A, B, EOS, answer_ids, completion, make_intake

from echo2swarm.config.rl import PeersConfig
from echo2swarm.learner.accountability import PeerLedger
from echo2swarm.wire.work import GroupSubmission, Lease, LeaseRequest, LeaseWait


def _lease(intake, peer: str, n: int = 2):
    return asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=n, held_version=5), peer))


def _right_group(lease: Lease, index: int = 0) -> GroupSubmission:
    prompt = lease.prompts[index]
    a, b = prompt.text.rstrip("=").split("+")
    ids = answer_ids(str(int(a) + int(b)))
    return GroupSubmission(lease_id=lease.lease_id, prompt_id=prompt.prompt_id, version=5, generation_s=0.1,
                           completions=[completion(ids), completion(ids)])


def test_a_newcomer_is_on_probation_until_enough_of_its_work_is_verified() -> None:
    ledger = PeerLedger(PeersConfig(probation_prompts=2, graduate_after_groups=3))
    assert ledger.allowance(A, want=8, open_leases=0, now=0.0) == 2
    ledger.issued(A, 2, now=0.0)
    assert ledger.allowance(A, want=8, open_leases=1, now=0.1) == 0 and ledger.stats["capped_probation"] == 1
    ledger.delivered(A, 2, now=1.0)
    # Delivering lifts the per-identity cap (the newcomers' pool still bounds it), not probation:
    assert ledger.on_probation(A) and ledger.allowance(A, want=8, open_leases=0, now=1.0) == 8
    ledger.verified(A, 2)
    assert ledger.on_probation(A)
    ledger.verified(A, 1)
    assert not ledger.on_probation(A) and ledger.stats["graduated"] == 1
    assert not PeerLedger(PeersConfig(enabled=False)).on_probation(A)


def test_undelivered_prompts_and_open_leases_are_capped_per_window() -> None:
    ledger = PeerLedger(PeersConfig(probation_prompts=2, max_undelivered_prompts=10, max_open_leases=3, window_s=60))
    ledger.delivered(A, 1, now=0.0)
    ledger.issued(A, 8, now=0.0)
    assert ledger.allowance(A, want=8, open_leases=1, now=1.0) == 3  # 10 - (8 - 1) undelivered
    assert ledger.allowance(A, want=8, open_leases=3, now=1.0) == 0  # three leases open
    assert ledger.allowance(A, want=8, open_leases=1, now=61.0) == 8  # the window moved on


def test_lies_lapses_and_failed_verification_ban_at_their_thresholds() -> None:
    ledger = PeerLedger(PeersConfig(ban_after_violations=2, ban_after_verify_failures=1, ban_after_lapsed_leases=2))
    assert ledger.strike(A, "bad_logprob", now=0.0) is None
    ban = ledger.strike(A, "foreign_lease", now=1.0)
    assert ban is not None and "foreign_lease" in ban.reason and ledger.banned(A) is ban
    assert ledger.strike(A, "bad_token", now=2.0) is None  # already banned: no second ban
    assert ledger.allowance(A, want=4, open_leases=0, now=3.0) == 0
    assert ledger.strike(B, "verify_logprob_gap", now=0.0) is not None
    ledger.lapsed("C" * 52, now=0.0)
    ledger.delivered("C" * 52, 1, now=1.0)  # a delivery resets the run of lapses
    ledger.lapsed("C" * 52, now=2.0)
    assert ledger.banned("C" * 52) is None
    assert ledger.lapsed("C" * 52, now=3.0) is not None
    assert set(ledger.snapshot()["banned"]) == {A, B, "C" * 52}


def test_memory_stays_bounded_under_a_flood_of_fresh_peer_ids() -> None:
    ledger = PeerLedger(PeersConfig(max_tracked_peers=16, ban_after_violations=1))
    for i in range(1000):
        ledger.allowance(f"peer{i}", want=1, open_leases=0, now=float(i))
        ledger.strike(f"liar{i}", "malformed", now=float(i))
    assert len(ledger.peers) <= 16 and len(ledger.bans) <= 16
    assert ledger.stats["peers_forgotten"] > 0 and ledger.stats["bans_forgotten"] > 0


def test_the_intake_bans_a_liar_revokes_its_leases_and_drops_its_groups() -> None:
    intake = make_intake(staleness=1, prompts_per_step=4, peers=PeersConfig(ban_after_violations=2, probation_prompts=2))
    honest = _lease(intake, A)
    assert intake.accept(_right_group(honest), A) is None
    liar_lease = _lease(intake, B)
    assert isinstance(liar_lease, Lease) and len(liar_lease.prompts) == 2  # probation share
    assert intake.accept(_right_group(liar_lease), B) is None  # one honest-looking group, buffered
    assert len(intake.buffer) == 2
    forged = _right_group(honest, 1)  # a group for A's lease
    assert intake.accept(forged, B) == "foreign_lease"
    bad = _right_group(liar_lease, 1).model_copy(update={"completions": [completion([5, 6, 7, EOS + 100])] * 2})
    assert intake.accept(bad, B) == "bad_token"  # second strike: banned
    assert intake.ledger.banned(B) is not None
    assert not any(lease.peer_id == B for lease in intake.leases.open.values())  # re-issued
    assert len(intake.buffer) == 1 and intake.buffer.dropped["banned"] == 1
    # The liar's prompts go to others: its open one and the one whose group was thrown away.
    liar_prompts = {int(p.prompt_id.split(":")[1]) for p in liar_lease.prompts}
    assert liar_prompts <= set(intake.leases.requeue) and intake.leases.stats["reissued_after_refusal"] == 1
    reply = _lease(intake, B)
    assert isinstance(reply, LeaseWait) and reply.done and "banned" in reply.reason
    assert intake.accept(_right_group(liar_lease, 1), B) == "banned"


def test_a_client_that_takes_leases_and_never_submits_holds_a_bounded_share() -> None:
    intake = make_intake(staleness=3, prompts_per_step=16, peers=PeersConfig(probation_prompts=2, ban_after_lapsed_leases=2))
    now = [0.0]
    intake.clock = lambda: now[0]
    taken = 0
    for _ in range(50):  # the hoarder asks again and again
        reply = _lease(intake, B, n=8)
        taken += len(reply.prompts) if isinstance(reply, Lease) else 0
    assert taken == 2  # its probation share, no more
    honest = _lease(intake, A, n=8)
    assert isinstance(honest, Lease) and len(honest.prompts) == 2
    for _ in range(2):  # its leases lapse, twice in a row: banned
        now[0] += intake.leases_config.timeout_s + 1
        intake.expire_leases()
        _lease(intake, B, n=8)
    assert intake.ledger.banned(B) is not None and "lapsed" in intake.ledger.banned(B).reason


def test_a_peer_gets_no_more_held_lease_requests_than_leases_it_may_hold() -> None:
    async def scenario() -> None:
        intake = make_intake(staleness=1, prompts_per_step=2, peers=PeersConfig(max_open_leases=2, probation_prompts=2))
        for peer in (A, B):  # both graduated: their work comes from the learner's budget
            intake.ledger.verified(peer, intake.ledger.config.graduate_after_groups)
        for _ in range(2):  # the learner's budget (4 prompts) is spent on A
            intake.ledger.delivered(A, 1, now=0.0)
            assert isinstance(await intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A), Lease)
        held = [asyncio.create_task(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5, wait_s=30), B))
                for _ in range(2)]
        for _ in range(10):
            await asyncio.sleep(0)  # let both handlers park on the learner's wait
        assert not any(t.done() for t in held)
        loop = asyncio.get_running_loop()
        started = loop.time()
        extra = await intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5, wait_s=30), B)
        assert isinstance(extra, LeaseWait) and loop.time() - started < 1.0  # answered at once, not held
        assert intake.ledger.stats["held_requests_refused"] == 1
        intake.finish()
        await asyncio.wait_for(asyncio.gather(*held), 5)

    asyncio.run(scenario())


def test_fresh_identities_share_one_newcomer_pool_outside_the_in_flight_budget() -> None:
    """A hundred keys that each take a newcomer's share and never deliver hold only the newcomers'
    pool: a graduated peer still gets the whole in-flight budget."""
    async def scenario() -> None:
        peers = PeersConfig(probation_prompts=2, newcomer_prompts=4)
        intake = make_intake(staleness=1, prompts_per_step=2, peers=peers)
        sybils = [f"12D3KooWSybil{i:039d}" for i in range(100)]
        granted = [await intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), s) for s in sybils]
        assert sum(isinstance(r, Lease) for r in granted) == 2  # 2 leases of 2 prompts fill the pool of 4
        assert intake.leases.open_prompts(newcomer=True) == 4 and intake.ledger.stats["newcomer_pool_full"] == 98
        assert {r.reason for r in granted if isinstance(r, LeaseWait)} == {"newcomers' share of the work is taken (probation)"}
        intake.ledger.delivered(A, peers.graduate_after_groups, now=0.0)
        intake.ledger.verified(A, peers.graduate_after_groups)
        lease = await intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A)
        assert isinstance(lease, Lease) and len(lease.prompts) == 2
        lease = await intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A)
        assert isinstance(lease, Lease) and len(lease.prompts) == 2  # the whole (S + 1) * R budget

    asyncio.run(scenario())


def test_a_refused_group_s_prompt_never_goes_back_to_its_peer() -> None:
    async def scenario() -> None:
        intake = make_intake(staleness=1, prompts_per_step=2)
        lease = await intake.rpc_lease(LeaseRequest(max_prompts=1, held_version=5), A)
        assert isinstance(lease, Lease)
        assert intake.accept(_right_group(lease), A) is None
        group = intake.buffer.take(5, 1)[0]
        intake.reissue([group])  # verification refused it
        again = await intake.rpc_lease(LeaseRequest(max_prompts=1, held_version=5), A)
        assert isinstance(again, Lease) and again.prompts[0].prompt_id != group.prompt_id
        other = await intake.rpc_lease(LeaseRequest(max_prompts=1, held_version=5), B)
        assert isinstance(other, Lease) and other.prompts[0].prompt_id == group.prompt_id
        assert intake.leases.avoid == {}

    asyncio.run(scenario())

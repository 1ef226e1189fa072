"""Lease bookkeeping and group acceptance rules of the learner's intake."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from helpers.intake import A, B, EOS, LIMITS, answer_ids, completion, make_intake

from echo2swarm.learner.accountability import VIOLATIONS
from echo2swarm.learner.leases import LeaseManager, check_group
from echo2swarm.wire.sampling import SAMPLER
from echo2swarm.wire.work import CompletionMsg, GroupSubmission, Lease, LeaseRequest, LeaseWait

def submission(version: int = 5, completions: list[CompletionMsg] | None = None, lease_id: str = "l", prompt_id: str = "p"):
    return GroupSubmission(lease_id=lease_id, prompt_id=prompt_id, version=version, generation_s=0.1,
                           completions=completions or [completion([5, EOS]), completion([6, 7, EOS])])


def test_leases_hand_out_in_order_and_reissue_expired_prompts_first():
    leases = LeaseManager(timeout_s=10, max_prompts=3)
    first = leases.issue(A, 5, budget=10, min_version=1, now=0.0)
    assert first is not None and sorted(first.prompts.values()) == [0, 1, 2]  # capped by max_prompts
    second = leases.issue(B, 2, budget=10, min_version=1, now=1.0)
    assert sorted(second.prompts.values()) == [3, 4]
    assert leases.issue(A, 3, budget=0, min_version=1, now=1.0) is None
    assert sum(len(lease.prompts) for lease in leases.expire(now=10.5)) == 3  # A's lease lapsed, B's has until 11.0
    again = leases.issue(B, 3, budget=10, min_version=1, now=10.6)
    assert sorted(again.prompts.values()) == [0, 1, 2] and leases.stats["reissued"] == 3
    assert leases.snapshot()["cursor"] == 5


def test_lease_checks_owner_prompt_and_duplicates():
    leases = LeaseManager(timeout_s=10, max_prompts=2)
    lease = leases.issue(A, 2, budget=2, min_version=1, now=0.0)
    pid = next(iter(lease.prompts))
    assert leases.check(B, lease.lease_id, pid) == "foreign_lease"
    assert leases.check(A, "nope", pid) == "unknown_lease"
    assert leases.check(A, lease.lease_id, "train:999") == "unknown_prompt"
    assert leases.check(A, lease.lease_id, pid) is None
    leases.complete(lease.lease_id, pid)
    assert leases.check(A, lease.lease_id, pid) == "duplicate"
    assert leases.drop_peer(A) == 1 and list(leases.requeue) == [1]  # the prompt still open goes back


@pytest.mark.parametrize(
    ("sub", "reason"),
    [
        (submission(version=6), "future_version"),
        (submission(version=3), "stale_version"),  # 5 - 3 > S=1
        (submission(completions=[completion([5, EOS])]), "bad_group_size"),
        (submission(completions=[completion([5, EOS]), CompletionMsg(token_ids=[5, EOS], logprobs=[-1.0], finish_reason="stop")]), "bad_shape"),
        (submission(completions=[completion([5, EOS]), completion([5, 6, 7, 8, EOS])]), "too_long"),
        (submission(completions=[completion([5, EOS]), completion([99, EOS])]), "bad_token"),
        (submission(completions=[completion([5, EOS]), CompletionMsg(token_ids=[5, EOS], logprobs=[0.5, -1], finish_reason="stop")]), "bad_logprob"),
        (submission(completions=[completion([5, EOS]), completion([5, 6], finish="stop")]), "bad_finish"),
        (submission(completions=[completion([5, EOS]), completion([5, EOS], finish="length")]), "bad_finish"),
        (submission(completions=[completion([5, EOS]), completion([EOS, 5, EOS])]), "bad_finish"),
    ],
)
def test_group_content_rules(sub: GroupSubmission, reason: str):
    assert check_group(sub, LIMITS, current_version=5, staleness=1) == reason


def test_group_within_window_passes_and_unpublished_versions_are_future():
    assert check_group(submission(version=4), LIMITS, current_version=5, staleness=1) is None
    assert check_group(submission(version=5), LIMITS, current_version=5, staleness=1, newest_published=4) == "future_version"


def test_intake_rewards_on_the_learner_and_refuses_foreign_groups():
    intake = make_intake()
    lease = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A))
    assert isinstance(lease, Lease) and len(lease.prompts) == 2
    prompt = lease.prompts[0]
    a, b = prompt.text.rstrip("=").split("+")
    right, wrong = answer_ids(str(int(a) + int(b))), answer_ids(str(int(a) + int(b) + 1))
    group = GroupSubmission(lease_id=lease.lease_id, prompt_id=prompt.prompt_id, version=5, generation_s=0.1,
                            completions=[completion(right), completion(wrong)])
    assert intake.accept(group, B) == "foreign_lease"
    assert intake.accept(group, A) is None
    assert intake.accept(group, A) == "duplicate"
    (buffered,) = intake.buffer.take(5, 1)
    assert buffered.rewards == [1.0, 0.0] and buffered.peer_id == A
    assert intake.refused == {"foreign_lease": 1, "duplicate": 1} and intake.delivered[A] == 1


def test_intake_budget_caps_work_in_flight_and_tells_stale_holders_to_fetch():
    intake = make_intake(staleness=1, prompts_per_step=2)  # capacity (S+1)R = 4 groups
    got = [asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A)) for _ in range(3)]
    assert [type(r) for r in got] == [Lease, Lease, LeaseWait]
    intake.published_version = 6
    intake.version = 6
    reply = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=4), B))
    assert isinstance(reply, LeaseWait) and "fetch v6" in reply.reason


def test_mid_step_leases_cover_only_the_steps_their_version_can_still_train():
    # While step 5 trains, the intake serves step 6 and v6 is not published yet: groups of v5 can
    # train steps 6 and 7 only (S = 2), so 2 steps x 2 prompts, not the full window of 3 steps.
    intake = make_intake(staleness=2, prompts_per_step=2)
    intake.version = 6
    got = [asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A)) for _ in range(3)]
    assert [type(r) for r in got] == [Lease, Lease, LeaseWait]
    assert not got[2].fetch_first  # v5 is the newest there is: nothing to fetch, just enough work out
    intake.published_version = 6  # once v6 is out, a peer holding it gets the window's last step too
    assert isinstance(asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=6), B)), Lease)


def test_a_held_lease_request_is_answered_the_moment_work_is_freed():
    async def scenario() -> None:
        intake = make_intake(staleness=1, prompts_per_step=2)  # capacity 4 prompts: two leases of 2
        for _ in range(2):
            assert isinstance(await intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A), Lease)
        held = asyncio.create_task(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5, wait_s=30), B))
        for _ in range(10):
            await asyncio.sleep(0)  # let the handler run up to its wait and park there
        assert not held.done()
        first = next(iter(intake.leases.open))
        intake.leases.drop_peer(intake.leases.open[first].peer_id)  # work comes back...
        assert not held.done()  # ...but the held request looks again only when told
        intake.work_freed()
        reply = await asyncio.wait_for(held, 5)
        assert isinstance(reply, Lease) and len(reply.prompts) == 2 and reply.held_s > 0

    asyncio.run(scenario())


def test_held_requests_end_at_the_learners_cap_and_stale_holders_are_answered_at_once():
    async def scenario() -> None:
        intake = make_intake(staleness=1, prompts_per_step=2, max_hold_s=0.2)
        for _ in range(2):
            await intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A)
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await asyncio.wait_for(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5, wait_s=30), B), 5)
        assert isinstance(reply, LeaseWait) and not reply.fetch_first
        assert 0.2 <= loop.time() - started < 2 and reply.held_s >= 0.2  # the learner's cap, not the peer's 30 s
        intake.published_version = intake.version = 6
        started = loop.time()
        stale = await intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=4, wait_s=30), B)
        assert isinstance(stale, LeaseWait) and stale.fetch_first and loop.time() - started < 0.1

    asyncio.run(scenario())


def test_undecodable_text_is_refused_but_a_cut_multibyte_tail_is_not():
    intake = make_intake()
    intake.decode = lambda ids: "7\ufffd" if ids[0] == 5 else "7"
    lease = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=1, held_version=5), A))
    pid = lease.prompts[0].prompt_id
    bad = GroupSubmission(lease_id=lease.lease_id, prompt_id=pid, version=5, generation_s=0.1,
                          completions=[completion([5, EOS]), completion([6, EOS])])
    assert intake.accept(bad, A) == "undecodable"
    cut = GroupSubmission(lease_id=lease.lease_id, prompt_id=pid, version=5, generation_s=0.1,
                          completions=[completion([5, 6, 7, 8], finish="length"), completion([6, EOS])])
    assert intake.accept(cut, A) is None


class Recorder:
    """A work gate that lets everyone work and records what is delivered."""

    standby_retry_s = 1.0

    def __init__(self, seen: list[tuple[str, int, float, float | None]]):
        self.seen = seen

    def gate(self, peer: str) -> str | None:
        return None

    def on_delivery(self, peer: str, rollouts: int, seconds: float, latency: float | None = None) -> None:
        self.seen.append((peer, rollouts, seconds, latency))

    def on_lapse(self, peer: str) -> None:
        self.seen.append((peer, 0, 0.0, None))

    def inflight_target(self, groups_per_step: int, headroom: float) -> int | None:
        return None


def test_a_peer_working_ahead_is_measured_by_its_work_not_by_how_long_it_held_the_lease():
    now, seen = [0.0], []
    intake = make_intake(gate=Recorder(seen))
    intake.clock = lambda: now[0]
    now[0] = 1.0
    intake._report_delivery(A, {"l1": (0.0, 16)})  # idle before: the work is issue to delivery
    now[0] = 2.0
    intake._report_delivery(A, {"l2": (0.5, 16)})  # prefetched at 0.5, worked on after l1 landed at 1.0
    now[0] = 2.001
    intake._report_delivery(A, {"l3": (1.0, 16)})  # landed with l2: carried into the next sample
    now[0] = 3.0
    intake._report_delivery(A, {"l4": (2.0, 16)})
    assert seen == [(A, 16, 1.0, 1.0), (A, 16, 1.0, 1.5), (A, 32, 1.0, 1.0)]


class Target(Recorder):
    """A gate whose measured in-flight target is fixed."""

    def __init__(self, target: int | None):
        super().__init__([])
        self.target = target

    def inflight_target(self, groups_per_step: int, headroom: float) -> int | None:
        return self.target


def test_in_flight_cap_follows_the_measured_target_within_the_staleness_bound() -> None:
    # S = 6, R = 2: the bound is (S + 1) R = 14 groups
    assert make_intake(staleness=6).capacity == 14  # no gate: the bound
    assert make_intake(staleness=6, gate=Target(None)).capacity == 14  # not measured yet
    assert make_intake(staleness=6, gate=Target(5)).capacity == 5
    assert make_intake(staleness=6, gate=Target(100)).capacity == 14
    assert make_intake(staleness=6, gate=Target(1)).capacity == 2  # never below one step's groups
    intake = make_intake(staleness=6, gate=Target(3))
    first = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A))
    second = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), B))
    assert len(first.prompts) == 2 and len(second.prompts) == 1  # 3 in flight, then the cap
    third = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), B))
    assert third.reason == "enough work in flight"


def test_each_lease_names_the_seeded_sampler_with_a_seed_of_its_own_and_groups_keep_them():
    intake = make_intake(staleness=1, prompts_per_step=4)
    leases = [asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=1, held_version=5), A)) for _ in range(4)]
    assert all(isinstance(lease, Lease) and lease.sampling.sampler == SAMPLER for lease in leases)
    seeds = [lease.sampling.seed for lease in leases]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**62 for s in seeds)
    assert seeds == [intake.leases.open[lease.lease_id].seed for lease in leases]  # the learner keeps its own copy

    def sent(lease: Lease, sampler: str | None) -> GroupSubmission:
        return GroupSubmission(lease_id=lease.lease_id, prompt_id=lease.prompts[0].prompt_id, version=5,
                               generation_s=0.1, completions=[completion([5, EOS]), completion([6, EOS])],
                               sampler=sampler)

    assert intake.accept(sent(leases[0], SAMPLER), A) is None
    assert intake.accept(sent(leases[1], None), A) is None  # not required here: it trains unseeded
    seeded, unseeded = intake.buffer.take(5, 2)
    assert (seeded.sampler, seeded.seed) == (SAMPLER, seeds[0]) and (unseeded.sampler, unseeded.seed) == (None, None)
    # Required (verify.require_seeded): anything but the lease's sampler is refused, with a reason the peer
    # sees and no strike, and the prompt goes back at once (no lapse for the peer).
    intake.limits = dataclasses.replace(LIMITS, sampler=SAMPLER)
    assert intake.accept(sent(leases[2], None), A) == "unseeded"
    assert intake.accept(sent(leases[3], "gumbel-other/2"), A) == "unseeded"
    assert intake.refused["unseeded"] == 2 and "unseeded" not in VIOLATIONS
    assert intake.leases.stats["prompts_released"] == 2 and not intake.leases.open
    again = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=1, held_version=5), A))
    assert again.prompts[0].prompt_id == leases[2].prompts[0].prompt_id
    assert intake.accept(sent(again, SAMPLER), A) is None


def test_a_stale_group_gives_its_prompt_back_at_once_without_a_lapse():
    intake = make_intake(staleness=1, prompts_per_step=2)
    lease = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=5), A))
    assert isinstance(lease, Lease)
    stale, fresh = lease.prompts
    intake.version = 7  # two steps on: version 5 is out of the window
    group = GroupSubmission(lease_id=lease.lease_id, prompt_id=stale.prompt_id, version=5, generation_s=0.1,
                            completions=[completion([5, EOS]), completion([6, EOS])])
    assert intake.accept(group, A) == "stale_version"
    index = int(stale.prompt_id.split(":")[1])
    assert list(intake.leases.requeue) == [index] and intake.leases.stats["prompts_released"] == 1
    assert stale.prompt_id not in intake.leases.open[lease.lease_id].prompts  # the lease keeps only the other
    assert intake.accept(group, A) == "duplicate"
    intake.accept(GroupSubmission(lease_id=lease.lease_id, prompt_id=fresh.prompt_id, version=5, generation_s=0.1,
                                  completions=[completion([5, EOS]), completion([6, EOS])]), A)
    assert lease.lease_id not in intake.leases.open  # closed with its last prompt: it can never lapse
    again = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=2, held_version=7), B))
    assert isinstance(again, Lease) and again.prompts[0].prompt_id == stale.prompt_id

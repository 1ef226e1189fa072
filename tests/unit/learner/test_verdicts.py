"""What the learner does with the verification's verdicts (learner/loop.py `Learner._judge`): a group
refused with proof is a strike, and two ban; an atypical one is counted, never struck (protocol.md
§10.4.1, "strikes")."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

from helpers.intake import A, B, EOS, completion, make_intake

from echo2swarm.config.rl import PeersConfig
from echo2swarm.learner.loop import Learner
from echo2swarm.train.verify import NO_STRIKE, REASONS
from echo2swarm.wire.work import GroupSubmission, Lease, LeaseRequest


def judge(intake, refused: list[tuple[str, str, str]]) -> None:
    learner = SimpleNamespace(intake=intake, ledger=intake.ledger,
                              activation=SimpleNamespace(on_verified=lambda peers: list(peers)))
    groups = intake.buffer.take(intake.version, intake.buffer.count_usable(intake.version))
    Learner._judge(learner, groups, refused)  # type: ignore[arg-type]


def deliver(intake, peer: str) -> str:
    lease = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=1, held_version=5), peer))
    assert isinstance(lease, Lease)
    prompt_id = lease.prompts[0].prompt_id
    assert intake.accept(GroupSubmission(lease_id=lease.lease_id, prompt_id=prompt_id, version=5, generation_s=0.1,
                                         completions=[completion([5, EOS]), completion([6, EOS])]), peer) is None
    return prompt_id


def test_a_sample_mismatch_is_a_strike_and_two_ban_while_atypical_text_never_is() -> None:
    intake = make_intake(staleness=1, prompts_per_step=8, peers=PeersConfig(probation_prompts=8))
    assert "sample_mismatch" in REASONS and NO_STRIKE == {"atypical_text"}
    for _ in range(3):  # more atypical refusals than the ban threshold: counted only
        judge(intake, [(B, deliver(intake, B), "atypical_text")])
    assert intake.ledger.banned(B) is None and intake.ledger.stats["verify_atypical"] == 3
    judge(intake, [(A, deliver(intake, A), "sample_mismatch")])
    assert intake.ledger.banned(A) is None
    judge(intake, [(A, deliver(intake, A), "sample_mismatch")])
    assert "verify_sample_mismatch (2x)" in intake.ledger.banned(A).reason  # peers.ban_after_verify_failures


def test_a_crossed_sequential_test_bans_at_once_and_the_peer_is_told_why() -> None:
    from echo2swarm.config.rl import VerifyConfig
    from echo2swarm.learner.evidence import PeerStatistics
    from echo2swarm.train.verify import GroupEvidence
    from echo2swarm.wire.work import LeaseWait

    intake = make_intake(staleness=1, prompts_per_step=8, peers=PeersConfig(probation_prompts=8))
    config = VerifyConfig()
    learner = SimpleNamespace(intake=intake, ledger=intake.ledger, statistics=PeerStatistics(config, max_peers=64),
                              activation=SimpleNamespace(on_verified=lambda peers: list(peers)))
    for n in range(1, 20):  # B: exact choices; A: a steady excess (a sampler at another temperature)
        groups_b, groups_a = deliver(intake, B), deliver(intake, A)
        groups = intake.buffer.take(intake.version, intake.buffer.count_usable(intake.version))
        Learner._judge(learner, groups, [], [GroupEvidence(B, groups_b, 28, 0.0, 0.1),  # type: ignore[arg-type]
                                             GroupEvidence(A, groups_a, 28, 1.16, 0.1)])
        if intake.ledger.banned(A):
            break
    # 1.16 - 28 x allowance a group past the allowance, until the sum reaches the threshold
    assert n == math.ceil(config.peer_choice_threshold / (1.16 - 28 * config.peer_choice_allowance) - 1e-9) > 1
    assert intake.ledger.banned(B) is None
    assert intake.ledger.banned(A).reason == "verify_peer_statistics (1x)"
    reply = asyncio.run(intake.rpc_lease(LeaseRequest(max_prompts=1, held_version=5), A))
    assert isinstance(reply, LeaseWait) and reply.done and "verify_peer_statistics" in reply.reason

"""An intake over the arith task with a character tokenizer, and the groups its tests submit."""

from __future__ import annotations

from echo2swarm.config.rl import LeaseConfig, PeersConfig, TrainConfig
from echo2swarm.learner.accountability import PeerLedger
from echo2swarm.learner.intake import Intake, WorkGate
from echo2swarm.learner.leases import GroupLimits
from echo2swarm.models.tiny import build_char_tokenizer
from echo2swarm.tasks.registry import get_task
from echo2swarm.wire.work import CompletionMsg

A, B = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
EOS = 2
LIMITS = GroupLimits(group_size=2, max_new_tokens=4, vocab_size=49, eos_token_ids=frozenset({EOS}))


def completion(ids: list[int], finish: str = "stop") -> CompletionMsg:
    return CompletionMsg(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish)


def make_intake(staleness: int = 1, prompts_per_step: int = 2, max_hold_s: float = 5.0, gate: WorkGate | None = None,
                peers: PeersConfig = PeersConfig(enabled=False)) -> Intake:
    """Per-peer caps and bans are off unless `peers` turns them on: most intake tests are about the
    learner's own budget; test_accountability.py tests the caps and bans."""
    tokenizer = build_char_tokenizer()
    train = TrainConfig(staleness=staleness, prompts_per_step=prompts_per_step, group_size=2, max_new_tokens=4)
    return Intake(
        get_task("arith", seed=0), train, LeaseConfig(max_prompts=2, max_hold_s=max_hold_s),
        encode=lambda t: tokenizer(t)["input_ids"], decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        limits=LIMITS, version=5, gate=gate, ledger=PeerLedger(peers),
    )


def answer_ids(text: str) -> list[int]:
    tokenizer = build_char_tokenizer()
    return tokenizer(text)["input_ids"] + [EOS]

"""Per-peer sequential tests: what one group's check cannot prove, a peer's many groups can.

    trainer.step ─► stats["group_evidence"]: per group measured under its own version (train/verify.py
                    `GroupEvidence`): choice evidence e over its n re-derived positions, signed typicality z
      ─► PeerStatistics.observe, per group, per peer (CUSUMs, each reset to 0 when it would go negative):
           choices     C = max(0, C + e − peer_choice_allowance · n)        C ≥ peer_choice_threshold ─┐
           typicality  U = max(0, U + z' − peer_z_allowance)                 U ≥ peer_z_threshold  ────┼─► Crossing
                       L = max(0, L − z' − peer_z_allowance), z' = z clipped to ±Z_CLIP   L ≥ same ────┘
      ─► learner/loop.py `_judge`: a crossing bans the peer for the run (`verify_peer_statistics`)

An honest seeded sampler's token is the argmax of the perturbed scores up to its engine's numeric
noise, so its choice evidence is 0 (fp32 engines) or a trickle far below the allowance (bf16); a
sampler at another temperature or top_p moves a few positions of most groups by a fair fraction of
δ, too little for one group's refusal but a steady drift here. Typicality catches, over many groups,
a sampler whose text is steadily more probable (colder, greedy: L) or less probable (hotter, another
model: U) than sampling gives. The allowances and thresholds, and the false alarms they give honest
peers: docs/protocol.md §10.4.1 and docs/benchmarks.md ("Attacks on sampling").

Memory: three floats and two counts per peer, for at most `max_peers` peers (the least recently seen
forgotten first, its sums with it). Pure logic: tests/unit/learner/test_evidence.py.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from echo2swarm.config.rl import VerifyConfig
from echo2swarm.train.verify import GroupEvidence

__all__ = ["Crossing", "PeerStatistics", "Z_CLIP"]

Z_CLIP = 4.0
"""|z| a single group adds at most: the honest tail of z is heavier than a normal's (one group must not
carry a peer past the threshold); the colder and hotter samplers this test is for shift every group a little."""


@dataclass
class _Sums:
    choice: float = 0.0
    upper: float = 0.0
    lower: float = 0.0
    groups: int = 0  # groups observed (with any measurement)
    choice_groups: int = 0  # of which, with re-derived choices


@dataclass(frozen=True)
class Crossing:
    """A peer's test crossed its threshold: proof enough to ban it."""

    peer_id: str
    test: str  # "choices", "typicality_high" or "typicality_low"
    value: float
    threshold: float
    groups: int

    def describe(self) -> str:
        return f"{self.test} CUSUM {self.value:.3g} >= {self.threshold:g} over {self.groups} groups"


class PeerStatistics:
    """
    >>> stats = PeerStatistics(VerifyConfig(), max_peers=10_000)
    >>> stats.observe(GroupEvidence("12D3...", "train:7", positions=24, choice=0.0, z=-0.4))  # None: nothing crossed
    """

    def __init__(self, config: VerifyConfig, *, max_peers: int):
        self.config = config
        self.max_peers = max_peers
        self._peers: OrderedDict[str, _Sums] = OrderedDict()

    def observe(self, evidence: GroupEvidence) -> Crossing | None:
        """Add one group's evidence to its peer's sums; the first test it makes cross, if any."""
        cfg = self.config
        sums = self._sums(evidence.peer_id)
        sums.groups += 1
        crossing: Crossing | None = None
        if evidence.choice is not None and cfg.peer_choice_threshold is not None:
            sums.choice_groups += 1
            sums.choice = max(0.0, sums.choice + evidence.choice - cfg.peer_choice_allowance * evidence.positions)
            if sums.choice >= cfg.peer_choice_threshold:
                crossing = Crossing(evidence.peer_id, "choices", sums.choice, cfg.peer_choice_threshold,
                                    sums.choice_groups)
        if evidence.z is not None and cfg.peer_z_threshold is not None:
            z = max(-Z_CLIP, min(Z_CLIP, evidence.z))
            sums.upper = max(0.0, sums.upper + z - cfg.peer_z_allowance)
            sums.lower = max(0.0, sums.lower - z - cfg.peer_z_allowance)
            for test, value in (("typicality_high", sums.upper), ("typicality_low", sums.lower)):
                if crossing is None and value >= cfg.peer_z_threshold:
                    crossing = Crossing(evidence.peer_id, test, value, cfg.peer_z_threshold, sums.groups)
        if crossing is not None:
            self._peers.pop(evidence.peer_id, None)  # judged: a ban follows, and the sums start again if it does not
        return crossing

    def snapshot(self, peer: str) -> dict[str, float] | None:
        """The peer's sums (None when not tracked)."""
        sums = self._peers.get(peer)
        if sums is None:
            return None
        return {"choice": sums.choice, "typicality_high": sums.upper, "typicality_low": sums.lower,
                "groups": sums.groups, "choice_groups": sums.choice_groups}

    def __len__(self) -> int:
        return len(self._peers)

    def _sums(self, peer: str) -> _Sums:
        sums = self._peers.get(peer)
        if sums is None:
            sums = self._peers[peer] = _Sums()
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        return sums

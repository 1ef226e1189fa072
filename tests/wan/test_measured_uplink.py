"""Measured uplinks reach the cards: two public relays whose lines the kernel caps at 8 and 24 Mbit/s
(no --upload-limit: the daemons are not told) head the plan's two chains and forward a version to
each other and to a third relay (capped by flag, so it is the chains' tail). The slow line is
saturated by its uploads and its card carries what it sustained; the fast one, paced by what
arrives for it to forward, is measured higher or not at all (the plan then counts on it as
uncapped). The followers do not hedge here: a hedge would take the slow head's requests to faster
sources and leave its line idle (hedging has its own tests: tests/hostile/test_slow_sources.py).
How plans use the figure: tests/unit/learner/test_broadcast_tracker.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2swarm.runtime.launcher import Launcher
from echo2swarm.runtime.processes import wait_until
from echo2swarm.wire.signing import PolicyKey
from tests.helpers.wanlab import WanLab
from tests.helpers.wanswarm import WanSwarm

CAPS_MBIT = {"slow": 8, "fast": 24}


def _model(path: Path) -> Path:
    from echo2swarm.models.tiny import build_tiny_model

    # ~18 MB of fp32 weights: each chain head forwards about that much (its stripe on, the other's to the tail).
    model, tokenizer = build_tiny_model(seed=0, hidden_size=512, num_layers=2, num_heads=8)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cards_carry_the_uplink_each_peer_sustained(lab: WanLab, launcher: Launcher | None, tmp_path: Path, policy_key: Path) -> None:
    swarm = WanSwarm(lab, tmp_path / "swarm", "up", launcher)
    try:
        swarm.bootstrap(lab.public_host("boot"))
        trust = PolicyKey.load(policy_key).public.text
        no_hedge = tmp_path / "relay.toml"
        no_hedge.write_text("[fetch]\nhedge_after = 0\n")
        relays = {name: swarm.start(lab.public_host(name, up_mbit=mbit), name, "--role", "relay", "--trust", trust,
                                    "--config", str(no_hedge))
                  for name, mbit in CAPS_MBIT.items()}
        tail = swarm.start(lab.public_host("tail"), "tail", "--role", "relay", "--trust", trust,
                           "--upload-limit", "64KiB", "--config", str(no_hedge))
        for d in [*relays.values(), tail]:
            d.wait_ready(90)
        learner = swarm.start(lab.public_host("lrn"), "learner", "--role", "learner", "--model",
                              str(_model(tmp_path / "model")), "--policy-key", str(policy_key),
                              "--chunk-size", "256KiB")
        learner.wait_ready(120)
        wait_until(lambda: all(swarm.info(d)["version"] == 1 for d in [*relays.values(), tail]), 150,
                   interval=1.0, what="the relays to hold v1")
        measured = {name: swarm.info(d)["stats"]["server"]["uplink_bps"] for name, d in relays.items()}
        served = {name: swarm.info(d)["stats"]["server"].get("bytes_served", 0) for name, d in relays.items()}
        windows = {name: swarm.info(d)["stats"]["server"]["uplink_windows"] for name, d in relays.items()}
        print(json.dumps({"measured_bps": measured, "served": served, "busy_windows": windows}))
        line = {name: mbit * 1e6 / 8 for name, mbit in CAPS_MBIT.items()}
        assert served["slow"] > 8e6, f"the slow head forwarded too little to be measured: {served}"
        assert measured["slow"] is not None, f"slow: no busy window measured ({served['slow']} bytes served)"
        assert 0.5 * line["slow"] <= measured["slow"] <= 1.5 * line["slow"], (measured, line)  # writes return at the socket buffer
        assert measured["fast"] is None or 1.5 * measured["slow"] < measured["fast"] <= 1.5 * line["fast"], measured

        def card_uplinks() -> dict[str, int | None]:
            out = swarm.cli(lab.hosts["boot"], "peers", "--json", "--swarm", "up", "--initial-peers",
                            swarm.initial_peers[0])
            cards = {c["peer_id"]: c for c in json.loads(out.stdout)} if out.returncode == 0 else {}
            return {name: cards.get(d.info["peer_id"], {}).get("uplink_bps") for name, d in relays.items()}

        def slow_measured() -> dict[str, int | None] | None:
            uplinks = card_uplinks()
            return uplinks if uplinks["slow"] else None

        uplinks = wait_until(slow_measured, 60, interval=1.0, what="the slow relay's card to carry its measured uplink")
        assert 0.5 * line["slow"] <= uplinks["slow"] <= 1.5 * line["slow"], uplinks
    finally:
        swarm.close()

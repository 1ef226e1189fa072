"""Rollout peers that sample otherwise than the lease says must be refused and banned, an honest one never.

One training swarm: a learner, an honest paced rollout peer, and beside it eight real rollout peer
processes modified as an attacker would (tests/helpers/attacker.py patches the transformers engine,
then runs the daemon): (a) another model of the same architecture, (b) T + 0.2 and T - 0.2, (c) top_p
0.9 when the lease says 1.0, (d) the best of 4 draws per slot by the task's reward, (e) greedy, (f) the
weights it held 10 loads ago declared as the current version, (g) groups of earlier leases re-sent.
Each reports the policy's true logprobs, so only its choices lie: the seeded-choice check refuses
groups as `sample_mismatch`, and the per-peer sequential tests ban what single groups do not prove
(`verify_peer_statistics`). Each attacker must be banned for verification, and be told why; the
honest peer must never have a group refused by verification nor be banned.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.attacker import ATTACKS
from helpers.rogue import PACED
from helpers.swarm import LocalSwarm, http_json, learner_toml, read_metrics, stalled_report, wait_until

from echo2swarm.runtime.launcher import Launcher
from echo2swarm.runtime.processes import DaemonProcess, loopback_args

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]  # the first to ask for warm_model_dir builds it

TESTS = Path(__file__).resolve().parents[1]
# A deadline, not a measurement: the bans come within 50 groups (scripts/bench_verify.py); with the
# suite's other tests on the same two cores the slowest attacker can take minutes to deliver them.
BAN_TIMEOUT_S = 300.0
# In-process engines (the patch lives in the daemon's process), paced like the honest peer.
ATTACKER_ENV = {**PACED, "ECHO2SWARM_ENGINE__ISOLATE": "false", "ECHO2SWARM_ENGINE__TYPE": "transformers",
                "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


class AttackSwarm:
    def __init__(self, swarm: LocalSwarm, learner: DaemonProcess, honest: DaemonProcess,
                 attackers: dict[str, DaemonProcess]):
        self.swarm, self.learner, self.honest, self.attackers = swarm, learner, honest, attackers
        self.info = learner.info["chunk_url"] + "/v1/info"

    def banned(self) -> dict[str, str]:
        return http_json(self.info)["stats"].get("peers", {}).get("banned", {})


class Attacker(DaemonProcess):
    """A rollout daemon as LocalSwarm.rollout starts one, run by helpers.attacker in the same process:
    forked from the suite's launcher as `python -m helpers.attacker ATTACK daemon ARGS` where the swarm
    has one, else that command line spawned."""

    def __init__(self, swarm: LocalSwarm, attack: str, trust: Path):
        args = [*loopback_args(swarm.swarm, "DEBUG"), "--initial-peers", str(swarm.bootstrap_addr), "--role", "rollout",
                "--price", "0.3", "--trust", str(trust)]
        wrap = None if swarm.launcher else [sys.executable, "-m", "helpers.attacker", attack]
        super().__init__(f"attacker-{attack}", args, swarm.root / f"attacker-{attack}", env=ATTACKER_ENV, wrap=wrap)
        self.attack, self.fork_from = attack, swarm.launcher

    def start(self) -> "Attacker":
        if self.fork_from is None:
            super().start()
            return self
        self.proc = self.fork_from.launch_cli([self.attack, "daemon", *self.args], self.prepare(), self.log_path,
                                              module="helpers.attacker")
        return self


def start_attacker(swarm: LocalSwarm, attack: str, trust: Path) -> DaemonProcess:
    daemon = Attacker(swarm, attack, trust)
    swarm.daemons.append(daemon.start())
    return daemon


@pytest.fixture(scope="module")
def attack_swarm(warm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
                 launcher: Launcher | None) -> Iterator[AttackSwarm]:
    from echo2swarm.wire.signing import PolicyKey

    root = tmp_path_factory.mktemp("sampling-attacks")
    key = root / "learner.key"
    PolicyKey.generate().save(key)
    swarm = LocalSwarm(root / "swarm", swarm="t" + str(abs(hash(request.node.nodeid)) % 10**8))
    swarm.launcher = launcher
    try:
        # S = 1 as the demo: most groups arrive one version old, where a newcomer's are all re-derived.
        # Leases of 30 s, not the tests' 5 s: ten daemons share two cores, and an attacker whose leases
        # lapse is banned for that before verification has judged what it sends.
        config = learner_toml(root / "learner.toml", warm_model_dir, key, steps=2000, prompts_per_step=16,
                              group_size=8, sections={"leases": {"timeout_s": 30.0}})
        swarm.bootstrap()
        learner = swarm.start("learner", "--config", str(config))
        honest = swarm.rollout("honest", trust=Path(f"{key}.pub"), env=PACED)
        attackers = {attack: start_attacker(swarm, attack, Path(f"{key}.pub")) for attack in ATTACKS}
        for daemon in (learner, honest, *attackers.values()):
            swarm.ready(daemon, timeout=180)
        yield AttackSwarm(swarm, learner, honest, attackers)
    finally:
        swarm.close()


@pytest.mark.slow
@pytest.mark.parametrize("attack", ATTACKS)
def test_an_attacker_is_refused_and_banned(attack_swarm: AttackSwarm, attack: str) -> None:
    peer = attack_swarm.attackers[attack].info["peer_id"]
    try:
        reason = wait_until(lambda: attack_swarm.banned().get(peer), BAN_TIMEOUT_S, interval=1.0,
                            what=f"the {attack} attacker to be banned")
    except TimeoutError as e:  # starved, or the swarm stopped stepping: say where they wait
        peers = [attack_swarm.honest, attack_swarm.attackers[attack]]
        raise AssertionError(f"{e}\n{stalled_report(attack_swarm.info, attack_swarm.learner, peers)}") from e
    # Banned by verification: two groups refused as proof (sample_mismatch, or exact_mismatch when its
    # claimed version is not what it sampled with), or its sequential test crossed.
    assert reason.startswith("verify_"), reason
    # The attacker is told why: its lease requests are answered with the ban and its reason.
    log = attack_swarm.attackers[attack].log_path
    wait_until(lambda: f"banned for this run: {reason}" in log.read_text(errors="replace"), 90, interval=1.0,
               what=f"the {attack} attacker to hear of its ban")


def test_the_honest_peer_beside_them_is_never_refused(attack_swarm: AttackSwarm) -> None:
    peer = attack_swarm.honest.info["peer_id"]
    banned = attack_swarm.banned()
    assert peer not in banned and set(banned) >= {d.info["peer_id"] for d in attack_swarm.attackers.values()}
    stats: dict[str, Any] = http_json(attack_swarm.info)["stats"]
    assert stats["accepted"] > 0
    learner_log = attack_swarm.learner.log_path.read_text(errors="replace")
    refused = [line for line in learner_log.splitlines() if "failed verification" in line and peer in line]
    assert refused == [], refused[:5]
    assert f"peer {peer} failed its sequential test" not in learner_log
    # It kept delivering groups that trained after the attackers were banned.
    metrics = attack_swarm.learner.state_dir / "run" / "metrics.jsonl"
    steps = len(read_metrics(metrics))
    try:
        wait_until(lambda: len(read_metrics(metrics)) >= steps + 3, 120, what="training to go on with the honest peer")
    except TimeoutError as e:  # the swarm stopped stepping: say where the learner and the honest peer wait
        raise AssertionError(f"{e}\n{stalled_report(attack_swarm.info, attack_swarm.learner, [attack_swarm.honest])}") from e

"""What a daemon prints once it is up: the training it runs, how to join, where its pages are."""

from __future__ import annotations

from pathlib import Path

from echo2swarm.config.models import BootstrapConfig, LearnerConfig, RolloutConfig
from echo2swarm.daemon.banner import start_banner

ADDR = "/ip4/10.0.0.2/tcp/31337/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBmGhKbbstVWx9S"


def test_the_learner_says_what_it_trains_how_to_join_and_where_its_pages_are():
    config = LearnerConfig(
        state_dir=Path("runs/learner"),
        publish={"model": "runs/model", "policy_key": "runs/learner.key"},
        train={"task": "arith", "steps": 30, "staleness": 2, "prompts_per_step": 4, "group_size": 8},
        overlay={"swarm": "readme", "new_swarm": True},
    )
    lines = start_banner(config, "12D3KooWLearner", [ADDR], "http://10.0.0.2:31338", "http://10.0.0.2:31338",
                         ["/", "/v1/peers", "/metrics"])
    text = "\n".join(lines)
    assert lines[0] == "echo2swarm learner 12D3KooWLearner is up in swarm 'readme'; chunks at http://10.0.0.2:31338"
    assert f"  {ADDR}" in lines
    assert ("Training runs/model on task 'arith' for 30 steps: staleness S=2, a version every 1 step(s), "
            "4 prompts x 8 completions per step; run dir runs/learner/run") in lines
    assert ("  echo2swarm daemon --role rollout --price 0.3 --swarm readme --initial-peers <address> "
            "--trust runs/learner.key.pub") in lines
    assert lines[-2:] == ["Live swarm page: http://10.0.0.2:31338/", "Prometheus metrics: http://10.0.0.2:31338/metrics"]
    # Without the page's route (an older learner), no page is announced.
    assert "Live swarm page" not in "\n".join(start_banner(config, "p", [], None, "http://h:1", ["/metrics"]))
    assert "--swarm" in text


def test_other_roles_print_their_metrics_address_and_the_default_swarm_needs_no_flag():
    bootstrap = BootstrapConfig(overlay={"new_swarm": True})
    lines = start_banner(bootstrap, "12D3KooWBoot", [ADDR], None, "http://10.0.0.3:31338", ["/metrics"])
    assert lines[0] == "echo2swarm bootstrap 12D3KooWBoot is up in swarm 'echo2swarm'"
    assert lines[-1] == "Prometheus metrics: http://10.0.0.3:31338/metrics"
    assert not any(line.startswith("Training") for line in lines)
    rollout = RolloutConfig(overlay={"initial_peers": [ADDR]})
    assert start_banner(rollout, "p", [], None, None) == ["echo2swarm rollout p is up in swarm 'echo2swarm'"]
    learner = LearnerConfig(publish={"model": "m", "policy_key": "k"}, overlay={"new_swarm": True})
    join = next(line for line in start_banner(learner, "p", [ADDR], None, None) if "--role rollout" in line)
    assert "--swarm" not in join and join.endswith("--trust k.pub")

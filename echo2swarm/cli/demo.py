"""`echo2swarm demo`: a whole swarm on one machine, as separate processes on 127.0.0.1, learning arith or poker."""

from __future__ import annotations

import time
from pathlib import Path

import click

from echo2swarm.cli._common import warmup_options
from echo2swarm.control.capacity import DEFAULT_STALENESS
from echo2swarm.rollout.engines.base import ENGINE_KINDS


@click.command()
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where models, keys, state, logs, metrics and reward.png go. Default: runs/demo-<time>.")
@click.option("--task", type=click.Choice(["arith", "poker"]), default="arith", show_default=True,
              help="What the tiny model learns: two-number addition, or fold/call/raise in no-limit hold'em spots.")
@click.option("--rollout-peers", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--steps", type=click.IntRange(1), default=700, show_default=True, help="GRPO steps.")
@click.option("--staleness", type=click.IntRange(0), default=DEFAULT_STALENESS, show_default=True,
              help="S: rollouts of version x may train step t only if t - x <= S (0 = on-policy).")
@click.option("--engine", type=click.Choice(ENGINE_KINDS), default="auto", show_default=True,
              help="Rollout peers' engine; auto picks vllm when it imports, else transformers.")
@warmup_options
@click.option("--reward-target", type=float, default=None, help="Stop once the 10-step mean reward reaches this.")
@click.option("--swarm", default="demo", show_default=True)
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds allowed for training.")
def demo(run_dir, task, rollout_peers, steps, staleness, engine, warmup_steps, warmup_accuracy, reward_target, swarm,
         timeout) -> None:
    """Watch a swarm post-train a tiny model with GRPO: bootstrap + learner + rollout peers on this machine.

    RL post-training starts from a supervised model, so the tiny model first gets a supervised
    warm-up on the task until its greedy answers score --warmup-accuracy on train prompts (arith:
    the share answered right; poker: the mean reward, docs/tasks.md). For poker the defaults are
    300 steps and no target: constant answers already score 0.6-0.7 there.
    """
    from click.core import ParameterSource

    from echo2swarm.cli._common import fail
    from echo2swarm.rollout.engines import check_engine_installed

    try:
        check_engine_installed(engine)  # before minutes of warm-up, not when the rollout peers start
    except ValueError as e:
        fail(str(e))
    from echo2swarm.cli.demo_run import DEMO_TASKS, DemoOptions, run_demo

    context = click.get_current_context()  # the warm-up's defaults are the task's unless given
    if context.get_parameter_source("warmup_steps") == ParameterSource.DEFAULT:
        warmup_steps = DEMO_TASKS[task].warmup_steps
    if context.get_parameter_source("warmup_accuracy") == ParameterSource.DEFAULT:
        warmup_accuracy = DEMO_TASKS[task].warmup_accuracy

    options = DemoOptions(
        run_dir=run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"), task=task, rollout_peers=rollout_peers,
        swarm=swarm, steps=steps, staleness=staleness, engine=engine, warmup_steps=warmup_steps,
        warmup_accuracy=warmup_accuracy, reward_target=reward_target, timeout=timeout,
    )
    raise SystemExit(run_demo(options))

#!/usr/bin/env python
"""Swarm overhead: the same GRPO run in one process and through a local swarm, in one invocation.

    python scripts/bench_overhead.py [--steps 40] [--rollout-peers 2] [--staleness 1]

Same model (tiny Qwen3 after the same warm-up), task (arith), batch (prompts x group size), steps
and learning rate. The single-process baseline generates with the same engine class and trains
with the same trainer class, copying weights in memory. The swarm run is real daemons on
127.0.0.1: leases and trajectories over libp2p, a signed version published, fetched and
verified every step. Steps/s is measured after a few warm-up steps in both runs. Prints a table
and the ratio swarm / single-process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def single_process(model_dir: Path, args: argparse.Namespace) -> dict:
    import torch

    from echo2swarm.config.rl import TrainConfig
    from echo2swarm.train.group import Group
    from echo2swarm.train.trainer import GRPOTrainer
    from echo2swarm.rollout.engines.base import SamplingParams
    from echo2swarm.rollout.engines.hf import TransformersEngine
    from echo2swarm.tasks.registry import get_task

    torch.set_num_threads(args.threads)
    config = TrainConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                         max_new_tokens=args.max_new_tokens, staleness=0, threads=args.threads)
    trainer = GRPOTrainer(model_dir, config)
    engine = TransformersEngine(model_dir, threads=args.threads)
    task = get_task("arith", seed=0)
    times, rewards, cursor = [], [], 0
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        prompts = [task.prompt(cursor + i) for i in range(args.prompts_per_step)]
        cursor += args.prompts_per_step
        outputs = engine.generate([p.text for p in prompts], SamplingParams(
            n=args.group_size, max_new_tokens=args.max_new_tokens, seed=step))
        groups = []
        for prompt, completions in zip(prompts, outputs):
            groups.append(Group(
                prompt_id=prompt.prompt_id, version=step, prompt_ids=trainer.encode_prompt(prompt.text),
                completions=[c.token_ids for c in completions], behaviour_logprobs=[c.logprobs for c in completions],
                rewards=[task.reward(prompt.prompt_id, trainer.decode(c.token_ids), c.finish_reason == "stop")
                         for c in completions],
                finish_reasons=[c.finish_reason for c in completions],
            ))
        stats = trainer.step(groups, current_version=step)
        with torch.no_grad():  # on-policy: the engine gets the new weights in memory
            engine.model.load_state_dict(trainer.model.state_dict())
        times.append(time.perf_counter() - started)
        rewards.append(stats["reward_mean"])
    return {"step_times": times, "rewards": rewards}


def swarm(model_dir: Path, run_dir: Path, args: argparse.Namespace) -> dict:
    from echo2swarm.wire.signing import PolicyKey
    from echo2swarm.runtime.processes import DaemonProcess, loopback_args

    key = run_dir / "learner.key"
    PolicyKey.generate().save(key)
    config = run_dir / "learner.toml"
    config.write_text(
        f'role = "learner"\n[publish]\nmodel = "{model_dir}"\npolicy_key = "{key}"\n'
        f'[train]\ntask = "arith"\nsteps = {args.steps}\nstaleness = {args.staleness}\n'
        f"prompts_per_step = {args.prompts_per_step}\ngroup_size = {args.group_size}\n"
        f"max_new_tokens = {args.max_new_tokens}\nthreads = {args.swarm_threads}\ncheckpoint_every = 1000\n"
        "[leases]\nmax_prompts = 8\n"
    )
    common = loopback_args("bench", "WARNING")
    env = {"ECHO2SWARM_ENGINE__THREADS": str(args.swarm_threads)}
    daemons = []
    try:
        boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], run_dir / "bootstrap").start()
        daemons.append(boot)
        boot.wait_ready(60)
        join = ["--initial-peers", boot.maddr]
        learner = DaemonProcess("learner", [*common, *join, "--config", str(config)], run_dir / "learner").start()
        daemons.append(learner)
        for i in range(args.rollout_peers):
            daemons.append(DaemonProcess(f"rollout-{i}", [*common, *join, "--role", "rollout", "--trust", f"{key}.pub"],
                                         run_dir / f"rollout-{i}", env=env).start())
        assert learner.proc is not None
        learner.proc.wait(args.timeout)
        records = [json.loads(line) for line in (run_dir / "learner" / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        for d in reversed(daemons):
            d.terminate()
    times = [b["time_s"] - a["time_s"] for a, b in zip(records, records[1:])]
    return {"step_times": [records[0]["time_s"], *times], "rewards": [r["reward_mean"] for r in records],
            "bubble": records[-1]["bubble_ratio_total"], "dropped": records[-1]["dropped"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the rate (start-up)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--rollout-peers", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=500)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the single-process baseline")
    parser.add_argument("--swarm-threads", type=int, default=1, help="torch threads of each swarm process")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()

    from echo2swarm.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", seed=0, task="arith", warmup_steps=args.warmup_steps)
        base = single_process(model_dir, args)
        ours = swarm(model_dir, Path(tmp), args)

    def rate(times: list[float]) -> float:
        return 1.0 / statistics.mean(times[args.skip:])

    base_rate, swarm_rate = rate(base["step_times"]), rate(ours["step_times"])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"\nGRPO on arith, tiny Qwen3 ({args.prompts_per_step}x{args.group_size} rollouts/step, "
          f"{args.steps} steps, rate over steps {args.skip + 1}..{args.steps}), {os.cpu_count()} CPU cores")
    print(f"{'run':<32}{'steps/s':>10}{'s/step':>10}{'reward first10':>16}{'reward last10':>15}")
    print(f"{'single process (' + str(args.threads) + ' threads)':<32}{base_rate:>10.2f}{1 / base_rate:>10.3f}"
          f"{mean(base['rewards'][:10]):>16.3f}{mean(base['rewards'][-10:]):>15.3f}")
    label = f"swarm: learner + {args.rollout_peers} rollout, S={args.staleness}"
    print(f"{label:<32}{swarm_rate:>10.2f}{1 / swarm_rate:>10.3f}"
          f"{mean(ours['rewards'][:10]):>16.3f}{mean(ours['rewards'][-10:]):>15.3f}")
    print(f"swarm / single-process steps/s: {swarm_rate / base_rate:.2f}   "
          f"(swarm bubble ratio {ours['bubble']:.2f}, groups dropped {ours['dropped']})")


if __name__ == "__main__":
    main()

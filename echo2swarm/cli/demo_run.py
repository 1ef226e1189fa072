"""The demo's body (heavy imports allowed here; `cli.demo` imports it only when the demo runs).

    tiny model + supervised warm-up on the task (`arith` or `poker`) ─► greedy score on held-out prompts before
    bootstrap ─► learner (GRPO, publishes a signed version per step) ─► N rollout peers (--trust key.pub)
    watch: the learner's metrics.jsonl (step, reward, version, bubble) until it finishes
    after: greedy score of the final model, summary, reward.png; every daemon stopped by pid

The greedy score is the mean task reward of greedy answers to the task's eval prompts: accuracy
for arith, the share of the best action's EV range for poker (tasks/poker.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from echo2swarm.cli._common import WARMUP_ACCURACY, WARMUP_STEPS
from echo2swarm.config.rl import TrainConfig
from echo2swarm.learner.metrics import read_metrics
from echo2swarm.runtime.launcher import Launcher
from echo2swarm.runtime.processes import DaemonProcess, loopback_args

_TRAIN = TrainConfig()  # the learner's defaults, where the demo keeps them


@dataclass(frozen=True)
class DemoTask:
    """What the demo needs to know of a task the tiny model can learn."""

    max_new_tokens: int
    """Longest answer plus EOS, in the tiny model's characters."""
    score: str
    """What the mean reward of greedy answers is called for this task."""
    warmup_steps: int
    """The warm-up's default step cap."""
    warmup_accuracy: float | None
    """The warm-up's default target (greedy score on train prompts); None: run every step."""
    options: dict[str, str] = field(default_factory=dict)
    """``[train] task_options``, for the warm-up and the greedy score too."""
    lr: float = _TRAIN.lr
    """The learner's AdamW lr."""


# arith: scripts/bench_staleness.py, forced staleness, last-50-step reward of 300 steps over seeds 0-5:
# lr 2e-4 learns more than 3e-4 at S = 0 and keeps stale rollouts useful (the policy moves less between
# versions): see docs/benchmarks.md ("issue 18").
DEMO_LR = 2e-4


DEMO_TASKS: dict[str, DemoTask] = {
    "arith": DemoTask(max_new_tokens=4, score="greedy accuracy", warmup_steps=WARMUP_STEPS,
                      warmup_accuracy=WARMUP_ACCURACY, lr=DEMO_LR),
    # One letter (f, c, r) and EOS: the tiny character model drifts "call" into "cald" under RL.
    # No score target: folding everything already scores ~0.6 and calling everything ~0.7, so the
    # warm-up runs a fixed 300 steps, by which the model uses all three answers, and RL starts
    # from a policy that explores them.
    "poker": DemoTask(max_new_tokens=2, score="greedy reward", warmup_steps=300, warmup_accuracy=None,
                      options={"answers": "letters"}),
}


@dataclass
class DemoOptions:
    run_dir: Path
    task: str = "arith"
    rollout_peers: int = 2
    swarm: str = "demo"
    steps: int = 700
    staleness: int = _TRAIN.staleness
    engine: str = "auto"
    warmup_steps: int = WARMUP_STEPS
    warmup_accuracy: float | None = WARMUP_ACCURACY
    prompts_per_step: int = _TRAIN.prompts_per_step
    group_size: int = _TRAIN.group_size
    reward_target: float | None = None
    timeout: float = 900.0
    threads: int = 1


def _learner_toml(opts: DemoOptions, model_dir: Path, key_path: Path) -> Path:
    target = "" if opts.reward_target is None else f"reward_target = {opts.reward_target}\n"
    options = ", ".join(f"{k} = {json.dumps(v)}" for k, v in DEMO_TASKS[opts.task].options.items())
    path = opts.run_dir / "learner.toml"
    path.write_text(
        'role = "learner"\n'
        f'[publish]\nmodel = "{model_dir}"\npolicy_key = "{key_path}"\n'
        f'[train]\ntask = "{opts.task}"\ntask_options = {{ {options} }}\nsteps = {opts.steps}\nstaleness = {opts.staleness}\n'
        f"prompts_per_step = {opts.prompts_per_step}\ngroup_size = {opts.group_size}\n"
        f"max_new_tokens = {DEMO_TASKS[opts.task].max_new_tokens}\nlr = {DEMO_TASKS[opts.task].lr}\nthreads = {opts.threads}\ncheckpoint_every = 50\n{target}"
        '[leases]\nmax_prompts = 8\ntimeout_s = 20.0\n'
    )
    return path


def _score(model_dir: Path, task: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2swarm.models.warmup import greedy_accuracy
    from echo2swarm.tasks.registry import get_task

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    demo_task = DEMO_TASKS[task]
    return greedy_accuracy(model, tokenizer, get_task(task, seed=0, **demo_task.options),
                           max_new_tokens=demo_task.max_new_tokens)


def plot_reward(records: list[dict[str, Any]], out: Path, task: str = "arith") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["time_s"] for r in records]
    reward = [r["reward_mean"] for r in records]
    window = 10
    smooth = [sum(reward[max(0, i - window + 1):i + 1]) / len(reward[max(0, i - window + 1):i + 1]) for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(t, reward, color="tab:blue", alpha=0.3, label="reward (per step)")
    ax.plot(t, smooth, color="tab:blue", label=f"reward ({window}-step mean)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.plot(t, [r["bubble_ratio"] for r in records], color="tab:orange", alpha=0.6, label="bubble ratio")
    ax2.set_ylabel("bubble ratio (learner waiting)")
    ax2.set_ylim(0, 1)
    fig.legend(loc="upper left", bbox_to_anchor=(0.08, 0.92))
    ax.set_title(f"echo2swarm demo: GRPO on {task} over a local swarm")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run_demo(opts: DemoOptions) -> int:
    from echo2swarm.models.tiny import write_tiny_model
    from echo2swarm.wire.signing import PolicyKey
    from echo2swarm.runtime.logging import setup_logging

    setup_logging("WARNING")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if opts.task not in DEMO_TASKS:
        raise ValueError(f"the demo runs the tasks {', '.join(DEMO_TASKS)}, not {opts.task!r}")
    score = DEMO_TASKS[opts.task].score
    console = Console()
    run_dir = opts.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]echo2swarm demo[/bold] in {run_dir} (logs: {run_dir}/*/daemon.log)")
    # The daemons and their engine hosts fork from one process that imported torch, transformers and
    # hivemind once (runtime/launcher.py), instead of each importing them again on a laptop's cores.
    # It imports them while the model is warmed up and scored here.
    launcher = Launcher().start()
    try:
        model_dir = run_dir / "model"
        if not (model_dir / "config.json").exists():
            goal = "" if opts.warmup_accuracy is None else f" or {score} {opts.warmup_accuracy:g} on train prompts"
            with console.status(f"tiny Qwen3-style model: supervised warm-up on {opts.task} (up to {opts.warmup_steps} steps{goal})"):
                write_tiny_model(model_dir, seed=0, task=opts.task, warmup_steps=opts.warmup_steps,
                                 warmup_accuracy=opts.warmup_accuracy, task_options=DEMO_TASKS[opts.task].options)
        before = _score(model_dir, opts.task)
        console.print(f"  model {model_dir}: {score} on held-out {opts.task} prompts [bold]{before:.3f}[/bold]")
        key_path = run_dir / "learner.key"
        if not key_path.exists():
            PolicyKey.generate().save(key_path)
    except BaseException:
        launcher.close()
        raise

    common = loopback_args(opts.swarm)
    daemons: list[DaemonProcess] = []
    started = time.monotonic()
    try:
        boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], run_dir / "bootstrap",
                             launcher=launcher)
        daemons.append(boot.start())
        boot.wait_ready(60)
        join = ["--initial-peers", boot.maddr]
        learner = DaemonProcess("learner", [*common, *join, "--config", str(_learner_toml(opts, model_dir, key_path))],
                                run_dir / "learner", launcher=launcher)
        daemons.append(learner.start())
        for i in range(opts.rollout_peers):
            peer = DaemonProcess(
                f"rollout-{i + 1}",
                [*common, *join, "--role", "rollout", "--price", f"{0.2 + 0.1 * i:.2f}", "--trust", f"{key_path}.pub"],
                run_dir / f"rollout-{i + 1}", env={"ECHO2SWARM_ENGINE__TYPE": opts.engine, "OMP_NUM_THREADS": "1",
                                                    "ECHO2SWARM_ENGINE__THREADS": str(opts.threads)},
                launcher=launcher,
            )
            daemons.append(peer.start())
        learner.wait_ready(120)
        console.print(f"  swarm '{opts.swarm}': bootstrap, learner, {opts.rollout_peers} rollout peers; "
                      f"staleness S={opts.staleness}, {opts.prompts_per_step}x{opts.group_size} rollouts per step")
        records = _follow(console, learner, run_dir / "learner" / "run" / "metrics.jsonl", opts, started)
        final = run_dir / "learner" / "run" / "final"
        if not records or not (final / "config.json").exists():
            raise RuntimeError("the learner did not finish training")
        after = _score(final, opts.task)
        png = plot_reward(records, run_dir / "reward.png", opts.task)
        _summary(console, records, f"{score} (held-out {opts.task})", before, after, png, time.monotonic() - started)
        return 0
    except (TimeoutError, RuntimeError) as e:
        console.print(f"[red]demo failed:[/red] {e}")
        for d in daemons:
            console.print(f"--- {d.name} log tail ---\n{d.log_tail(15)}", markup=False)  # logs hold [/ip4/...]
        return 1
    finally:
        timings = [(d.name, d.terminate()) for d in reversed(daemons)]
        launcher.close()
        console.print("stopped: " + ", ".join(f"{name} in {secs:.1f}s" for name, secs in timings))


def _follow(console: Console, learner: DaemonProcess, metrics: Path, opts: DemoOptions, started: float) -> list[dict[str, Any]]:
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
    records: list[dict[str, Any]] = []
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("training", total=opts.steps, info="waiting for rollouts")
        while learner.running():
            if time.monotonic() - started > opts.timeout:
                raise TimeoutError(f"training did not finish within {opts.timeout:.0f} s")
            records = read_metrics(metrics)
            if records:
                last = records[-10:]
                reward = sum(r["reward_mean"] for r in last) / len(last)
                progress.update(task, completed=records[-1]["step"], info=(
                    f"reward {reward:.2f}  version {records[-1]['published_version']}  "
                    f"bubble {records[-1]['bubble_ratio_total']:.2f}"))
            time.sleep(0.5)
        records = read_metrics(metrics)
        if records:
            progress.update(task, completed=records[-1]["step"])
    return records


def _summary(console: Console, records: list[dict[str, Any]], label: str, before: float, after: float, png: Path,
             wall: float) -> None:
    from rich.table import Table

    first = records[: min(20, len(records))]
    last = records[-min(20, len(records)):]
    mean = lambda rs: sum(r["reward_mean"] for r in rs) / len(rs)  # noqa: E731
    end = records[-1]
    table = Table(title="demo summary", show_header=False, title_justify="left")
    table.add_row(label, f"{before:.3f} -> [bold]{after:.3f}[/bold] ({after - before:+.3f})")
    table.add_row("mean reward, first 20 -> last 20 steps", f"{mean(first):.3f} -> {mean(last):.3f}")
    table.add_row("steps / versions published", f"{end['step']} / {end['published_version']}")
    table.add_row("learner bubble ratio", f"{end['bubble_ratio_total']:.3f}")
    table.add_row("groups accepted / refused", f"{end['accepted']} / {sum(end['refused'].values())} {end['refused'] or ''}")
    table.add_row("groups dropped (staleness)", str(end["dropped"].get("stale", 0)))
    table.add_row("wall time", f"{wall:.0f} s")
    table.add_row("reward curve", str(png))
    console.print(table)

#!/usr/bin/env python
"""Does staleness cost learning? GRPO on arith in a real local swarm, swept over the bound S.

    python scripts/bench_staleness.py [--staleness 0,1,2,4,6,11] [--seeds 2] [--steps 300]
                                      [--forced 0,2,6] [--baseline 0] [--model DIR] [--png docs/bench_staleness.png]
                                      [--jobs N] [--variant NAME='{"ppo_epochs": 1}' ...] [--seed-offset K]

Every run is the demo's swarm (bootstrap, learner, 2 rollout peers on the transformers engine, separate
processes on 127.0.0.1) training the same warmed-up tiny model (copied into each run) for the same
number of steps with the same batch (16 prompts x 8 completions): equal steps, equal rollouts trained.

Modes, each over every S and seed:
- ``new``: today's defaults in the swarm (freshest-first schedule, in-flight cap from the capacity
  model, 2 minibatch updates a step with the decoupled clip).
- ``forced`` (``--forced``): the trust region alone, with staleness forced to exactly S: in one
  process, the real trainer (GRPOTrainer, today's defaults) and the real transformers engine; at
  step t the engine holds version max(1, t - S), so after the first S steps every group is exactly
  S versions old. Same task, model, batch and seeds as the swarm runs.
- ``old`` (``--baseline S,...``): the defaults before the staleness work (oldest-first schedule, in-flight
  (S + 1) R, one update a step, so the PPO ratio is exactly 1, and the demo's lr before, 3e-4), for the
  "S = 0 no worse" check; with ``--forced``, also ``forced-old``: forced staleness with one update a
  step (and lr 3e-4).

- ``forced-NAME`` (``--variant NAME=JSON``, repeatable): forced staleness with these train fields
  overriding today's defaults (e.g. ``--variant e1m2='{"ppo_epochs": 1, "minibatches": 2}'``): for
  comparing trust-region settings on equal footing. Two publish fields may join them:
  ``publish_dtype`` (the dtype the engine runs, as publish.dtype; forced runs default to float32) and
  ``hold_ulps`` (publish.hold_ulps), e.g. ``--variant held='{"publish_dtype": "bfloat16", "hold_ulps": 1.0}'``:
  every version is published, in that dtype and by that rule, and the engine runs the published bytes.

``--jobs N`` runs the forced-mode runs N at a time in separate processes (one torch thread each; they
share nothing, so results do not depend on N); swarm runs stay one at a time, since their observed
staleness depends on timing.

Printed per run: last-50-step mean reward, greedy accuracy on held-out prompts before and after,
observed staleness (mean, share at S), groups dropped as stale, rollouts generated. Then a table
per mode of the seed-averaged last-50 reward and its ratio to S = 0 of the same mode, and a PNG of
the 20-step mean reward against the step, one line per S.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from echo2swarm.cli.demo_run import DEMO_LR  # noqa: E402

OLD_LR = 3e-4  # the demo's lr before the sweeps of issue 18 (the "today" the issue measured)
OLD_DEFAULTS = {"schedule": "oldest", "ppo_epochs": 1, "minibatches": 1, "inflight_headroom": 10.0, "lr": OLD_LR}
OLD_OBJECTIVE = {"ppo_epochs": 1, "minibatches": 1, "lr": OLD_LR}
TRAIN = {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 4, "lr": DEMO_LR, "threads": 1}
LAST = 50
MODES = ("new", "forced", "old", "forced-old")
PUBLISH_FIELDS = {"publish_dtype": "dtype", "hold_ulps": "hold_ulps"}  # variant field -> PublishConfig field


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=JSON-object`` of train fields -> (NAME, fields); the fields are checked against TrainConfig."""
    from echo2swarm.config.models import PublishConfig
    from echo2swarm.config.rl import TrainConfig

    name, sep, body = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME='{{\"field\": value, ...}}'")
    try:
        fields = json.loads(body)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--variant {name}: not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError(f"--variant {name}: expected a JSON object of train fields")
    try:
        PublishConfig(**{PUBLISH_FIELDS[k]: v for k, v in fields.items() if k in PUBLISH_FIELDS})
        TrainConfig(**{**TRAIN, **{k: v for k, v in fields.items() if k not in PUBLISH_FIELDS}})
    except Exception as exc:  # pydantic's message names the field
        raise argparse.ArgumentTypeError(f"--variant {name}: {exc}") from None
    return name, fields


def learner_toml(run: Path, model: Path, key: Path, staleness: int, seed: int, steps: int,
                 overrides: dict[str, Any]) -> Path:
    fields = "".join(f"{k} = {json.dumps(v)}\n" for k, v in {**TRAIN, **overrides}.items())
    path = run / "learner.toml"
    path.write_text(
        'role = "learner"\n'
        f'[publish]\nmodel = "{model}"\npolicy_key = "{key}"\n'
        f'[train]\ntask = "arith"\nsteps = {steps}\nstaleness = {staleness}\nseed = {seed}\n'
        f"checkpoint_every = 1000\n{fields}"
        '[leases]\nmax_prompts = 8\ntimeout_s = 20.0\n'
    )
    return path


def run_swarm(run: Path, model: Path, staleness: int, seed: int, steps: int, overrides: dict[str, Any],
              peers: int, timeout: float) -> list[dict[str, Any]]:
    from echo2swarm.learner.metrics import read_metrics
    from echo2swarm.runtime.processes import DaemonProcess, loopback_args
    from echo2swarm.wire.signing import PolicyKey

    run.mkdir(parents=True, exist_ok=True)
    key = run / "learner.key"
    PolicyKey.generate().save(key)
    common = loopback_args(f"stale-{run.name}", log_level="WARNING")
    daemons: list[DaemonProcess] = []
    metrics = run / "learner" / "run" / "metrics.jsonl"
    started = time.monotonic()
    try:
        boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], run / "bootstrap")
        daemons.append(boot.start())
        boot.wait_ready(60)
        join = ["--initial-peers", boot.maddr]
        toml = learner_toml(run, model, key, staleness, seed, steps, overrides)
        learner = DaemonProcess("learner", [*common, *join, "--config", str(toml)], run / "learner")
        daemons.append(learner.start())
        for i in range(peers):
            daemons.append(DaemonProcess(
                f"rollout-{i + 1}", [*common, *join, "--role", "rollout", "--price", f"{0.2 + 0.1 * i:.2f}",
                                     "--trust", f"{key}.pub"],
                run / f"rollout-{i + 1}", env={"ECHO2SWARM_ENGINE__TYPE": "transformers", "OMP_NUM_THREADS": "1",
                                               "ECHO2SWARM_ENGINE__THREADS": "1"},
            ).start())
        learner.wait_ready(120)
        last_report = 0.0
        while learner.running():
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{run.name}: training did not finish within {timeout:.0f} s")
            if time.monotonic() - last_report > 15:
                records = read_metrics(metrics)
                print(f"    {run.name}: step {records[-1]['step'] if records else 0}/{steps}", flush=True)
                last_report = time.monotonic()
            time.sleep(0.5)
        records = read_metrics(metrics)
        if len(records) < steps:
            raise RuntimeError(f"{run.name}: the learner stopped after {len(records)} of {steps} steps:\n"
                               f"{learner.log_tail(20)}")
        return records
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()


def run_forced(run: Path, model: Path, staleness: int, seed: int, steps: int,
               overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """Real trainer + real engine in one process; every group exactly `staleness` versions old
    once t > staleness (before that, version 1)."""
    import random

    import torch
    from safetensors.torch import save_file

    from echo2swarm.config.rl import TrainConfig, VerifyConfig
    from echo2swarm.train.group import Group
    from echo2swarm.train.rounding import publish_dtype
    from echo2swarm.train.trainer import GRPOTrainer
    from echo2swarm.rollout.engines import SamplingParams
    from echo2swarm.rollout.engines.hf import TransformersEngine
    from echo2swarm.tasks.registry import get_task

    torch.set_num_threads(1)
    publish = {k: overrides[k] for k in PUBLISH_FIELDS if k in overrides}
    train = {k: v for k, v in overrides.items() if k not in PUBLISH_FIELDS}
    config = TrainConfig(**{**TRAIN, "device": "cpu", **train}, staleness=max(staleness, 0), seed=seed)
    # Verification checks peers; here the engine is our own, so it is off (it changes nothing trained).
    trainer = GRPOTrainer(model, config, verify=VerifyConfig(enabled=False))
    dtype = publish_dtype(publish.get("publish_dtype", "float32"))
    hold = float(publish.get("hold_ulps", 0.5))

    def publish_version(version: int, previous: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        state = trainer.weights_state(dtype, previous, hold)
        version_dir = run / f"v{version}"
        version_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(version_dir / "model.safetensors"), metadata={"format": "pt"})
        snapshots[version] = version_dir
        return {k: v.clone() for k, v in state.items()}  # float32: the live parameters themselves

    snapshots: dict[int, Path] = {}
    published = publish_version(1, None)
    engine = TransformersEngine(model, device="cpu", threads=1)
    engine.load_weights(snapshots[1])
    task = get_task("arith", seed=seed)
    rng = random.Random(seed)
    engine_version, cursor, records = 1, 0, []
    started = time.monotonic()
    for t in range(1, steps + 1):
        source = max(1, t - staleness)
        if engine_version != source:
            engine.load_weights(snapshots[source])
            engine_version = source
        prompts = [task.prompt(cursor + i) for i in range(config.prompts_per_step)]
        cursor += len(prompts)
        params = SamplingParams(n=config.group_size, max_new_tokens=config.max_new_tokens,
                                temperature=config.temperature, seed=rng.getrandbits(62))
        groups = []
        for prompt, completions in zip(prompts, engine.generate([p.text for p in prompts], params)):
            groups.append(Group(
                prompt_id=prompt.prompt_id, version=source, prompt_ids=trainer.encode_prompt(prompt.text),
                completions=[c.token_ids for c in completions], behaviour_logprobs=[c.logprobs for c in completions],
                rewards=[float(task.reward(prompt.prompt_id, trainer.decode(c.token_ids), c.finish_reason == "stop"))
                         for c in completions],
                finish_reasons=[c.finish_reason for c in completions],
            ))
        stats = trainer.step(groups, t)
        stats.pop("refused_groups", None)
        stats.pop("group_evidence", None)
        published = publish_version(t + 1, published)
        for old in [v for v in snapshots if v < t + 1 - staleness and v != 1]:
            shutil.rmtree(snapshots.pop(old), ignore_errors=True)
        records.append({**stats, "step": t, "staleness": [t - source] * len(groups), "dropped": {},
                        "accepted": t * len(groups), "bubble_ratio_total": 0.0,
                        "time_s": time.monotonic() - started})
        if t % 50 == 0:
            print(f"    {run.name}: step {t}/{steps}", flush=True)
    engine.close()
    trainer.save_model_dir(run / "learner" / "run" / "final")
    return records


def one_run(root: Path, model: Path, mode: str, s: int, seed: int, overrides: dict[str, Any],
            args: argparse.Namespace) -> dict[str, Any]:
    """One run of a mode at bound s and a seed, in a fresh copy of the model; its summary."""
    run = root / f"{mode}-s{s}-seed{seed}"
    shutil.rmtree(run, ignore_errors=True)
    run_model = run / "model"
    shutil.copytree(model, run_model)
    t0 = time.monotonic()
    if mode.startswith("forced"):
        records = run_forced(run, run_model, s, seed, args.steps, overrides)
    else:
        records = run_swarm(run, run_model, s, seed, args.steps, overrides, args.peers, args.timeout)
    summary = summarise(records, s)
    summary["accuracy"] = accuracy(run / "learner" / "run" / "final")
    summary["wall_s"] = time.monotonic() - t0
    summary["seed"] = seed
    shutil.rmtree(run, ignore_errors=True)
    return summary


def accuracy(model_dir: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2swarm.models.warmup import greedy_accuracy
    from echo2swarm.tasks.registry import get_task

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return greedy_accuracy(model, tokenizer, get_task("arith", seed=0), max_new_tokens=4)


def summarise(records: list[dict[str, Any]], staleness: int) -> dict[str, Any]:
    ages = [a for r in records for a in r.get("staleness", [])]
    end = records[-1]
    return {
        "last50": statistics.fmean(r["reward_mean"] for r in records[-LAST:]),
        "first20": statistics.fmean(r["reward_mean"] for r in records[:20]),
        "staleness_mean": statistics.fmean(ages) if ages else 0.0,
        "at_bound": sum(a == staleness for a in ages) / max(1, len(ages)),
        "dropped_stale": end["dropped"].get("stale", 0),
        "accepted": end["accepted"],
        "clip_frac": statistics.fmean(r.get("clip_frac", 0.0) for r in records),
        "gap": statistics.fmean(r.get("offpolicy_gap_mean", 0.0) for r in records),
        "bubble": end["bubble_ratio_total"],
        "curve": [r["reward_mean"] for r in records],
    }


def ordered_modes(results: dict[str, Any]) -> list[str]:
    return [m for m in MODES if results.get(m)] + sorted(m for m in results if m not in MODES)


def plot(results: dict[str, dict[int, list[dict[str, Any]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ordered_modes(results)
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for s, runs in sorted(results[mode].items()):
            curves = [r["curve"] for r in runs]
            n = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
            smooth = [statistics.fmean(mean[max(0, i - 19):i + 1]) for i in range(n)]
            ax.plot(range(1, n + 1), smooth, label=f"S = {s}")
        ax.set_title({"new": "swarm, defaults", "forced": "staleness forced to S, defaults",
                      "old": "swarm, before (oldest-first, 1 update/step)",
                      "forced-old": "forced to S, before (1 update/step)"}.get(mode, f"forced to S, {mode[7:]}"))
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward (20-step mean, seed average)")
        ax.set_ylim(0, 1)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--staleness", default="0,1,2,4,6,11")
    parser.add_argument("--forced", default="0,2,6", help="S values for the forced-staleness mode ('' for none)")
    parser.add_argument("--baseline", default="", help="S values at which to also run the old defaults "
                        "(swarm, and forced where that S is in --forced); '' for none")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="a warmed-up model dir (default: warm one up)")
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None,
                        help="write the reward-vs-step plot here (default: docs/bench_staleness.png, "
                        "or no plot with --variants-only, whose runs are not the documented sweep)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's summary here")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    parser.add_argument("--jsonl", type=Path, default=None, help="append each run's summary here as it ends")
    parser.add_argument("--jobs", type=int, default=1, help="forced-mode runs at a time (separate processes)")
    parser.add_argument("--seed-offset", type=int, default=0, help="first seed (seeds K .. K + seeds - 1)")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=JSON",
                        help="a forced-mode variant: train fields over today's defaults, e.g. "
                        "e1m2='{\"ppo_epochs\": 1, \"minibatches\": 2}' (repeatable)")
    parser.add_argument("--variants-only", action="store_true",
                        help="forced mode: run only the --variant and --baseline settings, not today's defaults")
    args = parser.parse_args()
    if args.jobs < 1 or args.seeds < 1 or args.seed_offset < 0:
        parser.error("--jobs and --seeds must be >= 1 and --seed-offset >= 0")

    from echo2swarm.runtime.logging import setup_logging

    setup_logging("WARNING")
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-staleness-"))
    root.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from echo2swarm.cli._common import WARMUP_ACCURACY, WARMUP_STEPS
        from echo2swarm.models.tiny import write_tiny_model

        model = root / "model"
        if not (model / "config.json").exists():
            print(f"warming up a tiny model on arith in {model} ...", flush=True)
            write_tiny_model(model, seed=0, task="arith", warmup_steps=WARMUP_STEPS, warmup_accuracy=WARMUP_ACCURACY)
    start_accuracy = accuracy(model)
    print(f"model {model}: greedy accuracy {start_accuracy:.3f} (held-out arith)", flush=True)

    sweep = [int(s) for s in args.staleness.split(",") if s]
    forced = [int(s) for s in args.forced.split(",") if s]
    plans: list[tuple[str, int, dict[str, Any]]] = [("new", s, {}) for s in sweep]
    plans += [("forced", s, {}) for s in forced if not args.variants_only]
    baseline = [int(s) for s in args.baseline.split(",") if s]
    plans += [("old", s, OLD_DEFAULTS) for s in sweep if s in baseline]
    plans += [("forced-old", s, OLD_OBJECTIVE) for s in forced if s in baseline]
    plans += [(f"forced-{name}", s, fields) for name, fields in args.variant for s in forced]
    results: dict[str, dict[int, list[dict[str, Any]]]] = {}
    print(f"{'run':<22} {'last50':>7} {'first20':>7} {'acc':>13} {'stale mean':>10} {'at S':>6} "
          f"{'dropped':>7} {'clip':>6} {'gap':>6} {'bubble':>6} {'wall':>6}", flush=True)

    def report(mode: str, s: int, name: str, summary: dict[str, Any]) -> None:
        results.setdefault(mode, {}).setdefault(s, []).append(summary)
        print(f"{name:<22} {summary['last50']:7.3f} {summary['first20']:7.3f} "
              f"{start_accuracy:5.3f}->{summary['accuracy']:5.3f} {summary['staleness_mean']:10.2f} "
              f"{summary['at_bound']:6.0%} {summary['dropped_stale']:7d} {summary['clip_frac']:6.3f} "
              f"{summary['gap']:6.3f} {summary['bubble']:6.3f} {summary['wall_s']:5.0f}s", flush=True)
        if args.jsonl:
            with args.jsonl.open("a") as out:
                out.write(json.dumps({"mode": mode, "S": s, "run": name,
                                      **{k: v for k, v in summary.items() if k != "curve"}}) + "\n")

    runs = [(mode, s, overrides, seed) for seed in range(args.seed_offset, args.seed_offset + args.seeds)
            for mode, s, overrides in plans]
    pool_runs = [r for r in runs if r[0].startswith("forced")] if args.jobs > 1 else []
    pool = None
    if pool_runs:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn"))
        futures = {pool.submit(one_run, root, model, mode, s, seed, overrides, args): (mode, s, seed)
                   for mode, s, overrides, seed in pool_runs}
    try:
        for mode, s, overrides, seed in runs:
            if (mode, s, overrides, seed) not in pool_runs:
                report(mode, s, f"{mode}-s{s}-seed{seed}", one_run(root, model, mode, s, seed, overrides, args))
        if pool is not None:
            from concurrent.futures import as_completed

            for future in as_completed(futures):
                mode, s, seed = futures[future]
                report(mode, s, f"{mode}-s{s}-seed{seed}", future.result())
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)

    def zero_of(mode: str) -> float | None:
        runs = results.get(mode, {}).get(0)
        return statistics.fmean(r["last50"] for r in runs) if runs else None

    print(f"\nlast-{LAST}-step mean reward, averaged over {args.seeds} seeds; ratio to S = 0 of the same mode")
    print(f"{'mode':<14} {'S':>3} {'last50':>7} {'± se':>6} {'ratio':>6} {'stale mean':>10} {'acc after':>9} "
          f"{'dropped':>7} {'runs':>4}")
    for mode in ordered_modes(results):
        zero = zero_of(mode)
        for s, runs in sorted(results.get(mode, {}).items()):
            last50 = [r["last50"] for r in runs]
            mean = statistics.fmean(last50)
            se = statistics.stdev(last50) / len(last50) ** 0.5 if len(last50) > 1 else float("nan")
            ratio = f"{mean / zero:6.2f}" if zero else "     -"
            print(f"{mode:<14} {s:>3} {mean:7.3f} {se:6.3f} {ratio} "
                  f"{statistics.fmean(r['staleness_mean'] for r in runs):10.2f} "
                  f"{statistics.fmean(r['accuracy'] for r in runs):9.3f} "
                  f"{statistics.fmean(r['dropped_stale'] for r in runs):7.0f} {len(runs):4d}")
    png = args.png if args.png is not None or args.variants_only else Path("docs/bench_staleness.png")
    if png is not None:
        plot(results, png)
        print(f"\nplot: {png}")
    if args.json:
        args.json.write_text(json.dumps({m: {str(s): [{k: v for k, v in r.items() if k != 'curve'} for r in runs]
                                             for s, runs in by_s.items()} for m, by_s in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

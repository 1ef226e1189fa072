#!/usr/bin/env python
"""Rollout engines, bare and through the swarm, in one invocation.

    python scripts/bench_engines.py [--engines transformers,vllm] [--seconds 20] [--publish-every 1]
                                    [--layout engine-core|one-core|in-thread]
    python scripts/bench_engines.py --sampling-cost [--vocab-size 151936] [--hidden-size 128]

1. Bare engines: each engine, in a process of its own, generates lease-sized batches (arith
   prompts x group size, temperature 1, with the leases' seeded sampler unless --sampling
   unseeded) for --seconds: completion tokens/s.
2. The same engine inside a rollout peer: bootstrap + learner (GRPO, a signed version every
   --publish-every steps) + one rollout peer on 127.0.0.1. The peer's tokens/s is read from its
   own counters over --seconds, after a few leases of start-up; it includes leases, submits,
   fetching and verifying versions, and the in-place weight loads.
3. The bare engine again, on the weights the peer ended with (training changes completion
   lengths, and tokens/s with them); the peer is compared with the mean of the two bare runs.

The bare engine runs twice each time (--bare-beside both, the default): with the other core
idle, and beside a stand-in for the learner (GRPO steps of the same shape on the same model, and
each step's weights serialised and hashed, in a loop on the learner's core). In the swarm run the
learner trains on that core all through the window, and the two cores share the caches and
memory of one machine, so the peer is held to the bare engine beside the stand-in, like against
like; the ratio to the idle-core runs is printed too (on the 2-core VM of docs/benchmarks.md the
two differ by less than the VM's own noise).

Fairness on a small machine: the measured engine runs alone on one core, the same core in both
parts, with one thread (OMP_NUM_THREADS=1); the learner, the bootstrap node and the bench itself
are pinned to the other. --layout says where the rest of the rollout peer runs: `engine-core`
(default) is the production shape, the engine in its own process on that core (`engine.cpus`)
and the daemon's control plane (DHT, chunk server, RPCs) beside the learner, as a GPU peer's
daemon runs on host cores beside the GPU it drives; `one-core` puts the daemon on the engine's
core too; `in-thread` runs the engine in a thread of the daemon (`engine.isolate = false`).

A learner on one core can train slower than a fast engine generates; the peer is then told to
wait for work. Those seconds are the learner's limit, not the peer's overhead, so the table shows
them (idle s) and the peer's rate over the rest of the window (busy tokens/s) next to its rate
over the whole window. An engine that computes in bursts is slower per second of computing
than one fed back to back (a tiny model's weights leave the core's caches while it idles), so
after the swarm run the bare engine runs once more paced like the peer: idle after each batch for
the share of the window the peer was told to wait (--no-paced skips it). A shared VM loses
seconds to its neighbours: the hypervisor's "steal" on the engine's core is printed for every
window; a window with much of it measured the host.

--sampling-cost measures only what the leases' seeded sampler (docs/protocol.md §10.7) costs: per
engine and round, the bare engine unseeded (its own generator), seeded, and unseeded again, one
window each on the same core; it prints seeded / the mean of the two unseeded tokens/s (target
>= 0.95). The noise is drawn per vocabulary entry, so --vocab-size widens the model's logits (the
tokenizer keeps its 49 symbols; 151936 is Qwen3's) to see the cost where it is largest: a narrow
model over a large vocabulary.

Prints a table and, per engine, swarm / bare tokens/s (target >= 0.95), where the peer's seconds
went (generating, starved for a lease, waiting for a version, round trips that overlapped), the
engine process's own compute seconds, weight loads, the learner's staleness and stale drops, and
CPU seconds by process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENGINE_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


@contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Run the body (and every process it starts) on `cpus`; None: leave affinity alone."""
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def bare(kind: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Runs in its own process: the engine generates lease-sized batches for args.seconds."""
    from echo2swarm.rollout.engines import SamplingParams, make_engine
    from echo2swarm.tasks.registry import get_task
    from echo2swarm.wire.sampling import SAMPLER

    started = time.perf_counter()
    engine = make_engine(kind, model_dir, threads=1, max_batch_sequences=args.prompts * args.group_size,
                         device=args.device,
                         vllm_options={"kv_cache_gib": args.kv_cache_gib})
    build_s = time.perf_counter() - started
    task = get_task("arith", seed=0)
    cursor = 0

    def batch(seed: int) -> tuple[int, int]:
        nonlocal cursor
        prompts = [task.prompt(cursor + i) for i in range(args.prompts)]
        cursor += args.prompts
        seeded = args.sampling == "seeded"  # as a lease asks: a 62-bit seed, the prompts' ids
        params = SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens, temperature=1.0,
                                seed=(2**61 + seed) if seeded else seed, sampler=SAMPLER if seeded else None,
                                prompt_ids=tuple(p.prompt_id for p in prompts) if seeded else None)
        groups = engine.generate([p.text for p in prompts], params)
        return sum(len(c.token_ids) for g in groups for c in g), sum(len(g) for g in groups)

    for seed in range(args.warmup_batches):
        batch(seed)
    tokens = rollouts = calls = 0
    computed = 0.0
    # --idle-share: after each batch, sit idle so that the engine idles that share of the window,
    # as a peer does whose learner cannot keep it busy.
    gap = args.idle_share / (1.0 - args.idle_share)
    stolen = steal_s(os.sched_getaffinity(0))
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        took = time.perf_counter()
        t, r = batch(1000 + calls)
        took = time.perf_counter() - took
        tokens, rollouts, calls, computed = tokens + t, rollouts + r, calls + 1, computed + took
        if gap:
            time.sleep(took * gap)
    seconds = time.perf_counter() - started
    stolen = steal_s(os.sched_getaffinity(0)) - stolen
    engine.close()
    return {"engine": engine.name, "sampling": args.sampling, "tokens_per_s": tokens / seconds, "rollouts_per_s": rollouts / seconds,
            "computing_tokens_per_s": tokens / max(computed, 1e-9), "idle_s": seconds - computed,
            "tokens_per_rollout": tokens / max(rollouts, 1),
            "batches": calls, "seconds": seconds, "build_s": build_s, "steal_s": stolen}


def learner_load(model_dir: Path, args: argparse.Namespace) -> None:
    """Runs in its own process until killed: the swarm learner's work on its core, without a swarm.

    GRPO steps on groups of the swarm run's shape (2 leases of prompts per step, the group size,
    completions of ~14 tokens, two versions old as the swarm's are), each step's weights
    serialised and hashed as a published version's are. Prints "ready" after the first step."""
    import hashlib
    import random

    from echo2swarm.config.rl import TrainConfig
    from echo2swarm.train.group import Group
    from echo2swarm.train.trainer import GRPOTrainer
    from echo2swarm.tasks.registry import get_task

    config = TrainConfig(task="arith", prompts_per_step=2 * args.prompts, group_size=args.group_size,
                         max_new_tokens=args.max_new_tokens, threads=1, device=args.device)
    trainer = GRPOTrainer(model_dir, config)
    task, rng = get_task("arith", seed=0), random.Random(0)
    step, parent = 2, os.getppid()
    while os.getppid() == parent:  # the bench kills it; should the bench die first, it stops too
        groups = [
            Group(prompt_id=str(i), version=step - 2, prompt_ids=trainer.encode_prompt(task.prompt(i).text),
                  completions=[[rng.randrange(3, trainer.vocab_size) for _ in range(14)] for _ in range(args.group_size)],
                  behaviour_logprobs=[[-2.0] * 14 for _ in range(args.group_size)],
                  rewards=[float(rng.random() < 0.5) for _ in range(args.group_size)],
                  finish_reasons=["length"] * args.group_size)
            for i in range(step * config.prompts_per_step, (step + 1) * config.prompts_per_step)
        ]
        trainer.step(groups, current_version=step)
        hashlib.sha256(trainer.weights_bytes()).digest()
        if step == 2:
            print("ready", flush=True)
        step += 1


@contextmanager
def beside_learner(cpus: set[int] | None, model_dir: Path, args: argparse.Namespace) -> Iterator[None]:
    """The body runs while `learner_load` keeps `cpus` busy (None: nothing runs beside it)."""
    if cpus is None:
        yield
        return
    command = [sys.executable, __file__, "--learner-load", "--model", str(model_dir), *args.passthrough]
    with pinned(cpus):
        load = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    try:
        if load.stdout is None or load.stdout.readline().strip() != "ready":  # blocks until its first step
            raise RuntimeError("the learner stand-in did not start")
        yield
    finally:
        load.kill()
        load.wait()


def cpu_model() -> str:
    """The CPU's model name and widest vector unit (Linux /proc/cpuinfo): engines' speed depends on both."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    vector = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no AVX")
    return f"{fields.get('model name', 'unknown CPU')} ({vector.replace('avx512f', 'avx512')})"


def steal_s(cores: set[int] | None) -> float:
    """Seconds the hypervisor ran something else while these cores (all, if None) had work: /proc/stat "steal".
    A VM's neighbours take them; a window with much steal measured the host, not our code."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or len(fields) < 8:
            continue
        if cores is None or int(name[3:]) in cores:
            total += int(fields[7])
    return total / tick


def run_bare(kind: str, model_dir: Path, args: argparse.Namespace, cpus: set[int] | None,
             idle_share: float = 0.0, sampling: str | None = None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--bare", kind, "--model", str(model_dir), *args.passthrough,
               f"--idle-share={idle_share}", f"--sampling={sampling or args.sampling}"]
    with pinned(cpus):
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                                env={**os.environ, **ENGINE_ENV}, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"bare {kind} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process ("daemon") and its descendants, by command name (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    stats: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        parents[int(entry.name)] = int(fields[1])
        stats[int(entry.name)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    out: dict[str, float] = {}
    for pid in tree:
        if pid in stats:
            comm, seconds = stats[pid]
            comm = "daemon" if pid == root else comm
            out[comm] = out.get(comm, 0.0) + seconds
    return out


def _info(daemon: Any) -> dict[str, Any]:
    with urllib.request.urlopen(daemon.info["chunk_url"] + "/v1/info", timeout=5) as reply:
        return json.loads(reply.read())["stats"]


def _at_lease_end(peer: Any, timeout: float) -> tuple[dict[str, Any], float]:
    """The peer's counters right after a lease finishes generating, and when: windows that start and end
    on lease boundaries count whole leases' tokens (a lease takes up to ~0.5 s; a window 20 s)."""
    seen = _info(peer).get("worker", {}).get("rollouts", 0)
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        stats = _info(peer)
        if stats.get("worker", {}).get("rollouts", 0) != seen:
            return stats, time.perf_counter()
        time.sleep(0.005)  # polling for an event of another process: nothing to wait on
    raise TimeoutError("the rollout peer finished no lease")


def run_swarm(kind: str, model_dir: Path, run_dir: Path, args: argparse.Namespace,
              cpus: tuple[set[int], set[int]] | None, layout: str) -> dict[str, Any]:
    from echo2swarm.wire.signing import PolicyKey
    from echo2swarm.runtime.processes import DaemonProcess, loopback_args, wait_until

    run_dir.mkdir(parents=True)
    key = run_dir / "learner.key"
    PolicyKey.generate().save(key)
    config = run_dir / "learner.toml"
    config.write_text(
        f'role = "learner"\n[publish]\nmodel = "{model_dir}"\npolicy_key = "{key}"\n'
        f'[train]\ntask = "arith"\nsteps = 100000\nstaleness = {args.staleness}\n'
        f"publish_every = {args.publish_every}\nprompts_per_step = {2 * args.prompts}\n"
        f"group_size = {args.group_size}\nmax_new_tokens = {args.max_new_tokens}\nthreads = 1\n"
        f'device = "{args.device}"\n'
        f"checkpoint_every = 100000\n[leases]\nmax_prompts = {args.prompts}\n"
    )
    common = loopback_args("bench-engines", "WARNING")
    learner_cpus, peer_cpus = cpus if cpus is not None else (None, None)
    daemons: list[DaemonProcess] = []
    try:
        with pinned(learner_cpus):
            boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], run_dir / "bootstrap")
            daemons.append(boot.start())
            boot.wait_ready(60)
            join = ["--initial-peers", boot.maddr]
            learner = DaemonProcess("learner", [*common, *join, "--config", str(config)], run_dir / "learner",
                                    env={"OMP_NUM_THREADS": "1"})
            daemons.append(learner.start())
        env = {**ENGINE_ENV, "ECHO2SWARM_ENGINE__THREADS": "1",
               "ECHO2SWARM_ENGINE__MAX_BATCH_SEQUENCES": str(args.prompts * args.group_size),
               "ECHO2SWARM_ENGINE__VLLM__KV_CACHE_GIB": str(args.kv_cache_gib),
               "ECHO2SWARM_ENGINE__DEVICE": args.device}
        daemon_cpus = peer_cpus
        if layout == "engine-core" and peer_cpus is not None:
            # The engine's process alone on its core; the daemon's own work beside the learner.
            env["ECHO2SWARM_ENGINE__CPUS"] = json.dumps(sorted(peer_cpus))
            daemon_cpus = learner_cpus
        elif layout == "in-thread":
            env["ECHO2SWARM_ENGINE__ISOLATE"] = "false"
        with pinned(daemon_cpus):
            peer = DaemonProcess(
                "rollout", [*common, *join, "--role", "rollout", "--engine", kind, "--trust", f"{key}.pub"],
                run_dir / "rollout", env=env,
            )
            daemons.append(peer.start())
        learner.wait_ready(120)
        peer.wait_ready(120)
        skip = args.warmup_batches * args.prompts * args.group_size
        wait_until(lambda: _info(peer).get("worker", {}).get("rollouts", 0) >= skip, args.timeout,
                   interval=0.5, what=f"{kind} peer to generate {skip} rollouts")
        first, t1, cpu1 = *_at_lease_end(peer, args.timeout), tree_cpu(peer.pid)
        stolen = steal_s(peer_cpus)
        time.sleep(args.seconds)  # the measurement window itself, not a wait for a condition
        last, t2, cpu2 = *_at_lease_end(peer, args.timeout), tree_cpu(peer.pid)
        stolen = steal_s(peer_cpus) - stolen
        learner_stats = _info(learner)
    finally:
        for d in reversed(daemons):
            d.terminate()
    # The policy the peer ended the window with: the bare engine's second run uses it, so both
    # sides generate from comparable policies (training changes completion lengths, and with them
    # tokens/s: shorter completions spend more of each batch on prefill).
    from echo2swarm.policy.store import VersionStore

    from echo2swarm.learner.metrics import read_metrics

    steps = read_metrics(run_dir / "learner" / "run" / "metrics.jsonl")
    staleness = [s for record in steps for s in record["staleness"]]
    learning = {"steps": len(steps), "mean_staleness": sum(staleness) / max(len(staleness), 1),
                "accepted": steps[-1]["accepted"] if steps else 0,
                "dropped_stale": steps[-1]["dropped"].get("stale", 0) if steps else 0,
                "refused": steps[-1]["refused"] if steps else {}}
    store = VersionStore(run_dir / "rollout")
    trained = run_dir / "trained-model"
    shutil.copytree(store.dir(store.latest()), trained)
    seconds = t2 - t1
    worker_first, worker_last = first.get("worker", {}), last.get("worker", {})
    delta = lambda name: worker_last.get(name, 0) - worker_first.get(name, 0)  # noqa: E731
    busy = seconds - delta("wait_s")
    return {"engine": last.get("engine"), "tokens_per_s": delta("tokens") / seconds, "trained_model": trained,
            "learning": learning, "refits": delta("refits"), "steal_s": stolen, "refits_deferred": delta("refits_deferred"),
            "tokens_per_rollout": delta("tokens") / max(delta("rollouts"), 1),
            "rollouts_per_batch": delta("rollouts") / max(delta("batches"), 1),
            "busy_tokens_per_s": delta("tokens") / busy, "wait_s": delta("wait_s"),
            "rollouts_per_s": delta("rollouts") / seconds, "seconds": seconds, "waits": delta("waits"),
            "versions": (last.get("engine_version") or 0) - (first.get("engine_version") or 0),
            "refit_s": last.get("refit_s"), "learner_version": learner_stats.get("published_version"),
            "cpu": {name: round(cpu2[name] - cpu1.get(name, 0.0), 2) for name in cpu2},
            "host_busy_s": {k: v - ((first.get("engine_busy_s") or {}).get(k, 0.0))
                            for k, v in (last.get("engine_busy_s") or {}).items()},
            "split": {name: delta(name) for name in ("generate_s", "starved_s", "version_wait_s", "lease_rpc_s",
                                                     "submit_rpc_s")}}


def widen_vocabulary(model_dir: Path, vocab_size: int) -> None:
    """Give the model `vocab_size` output logits (and input embeddings), as a checkpoint whose config's
    vocab_size exceeds its tokenizer's; the new rows are initialised like the others."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.resize_token_embeddings(vocab_size, mean_resizing=False)
    model.save_pretrained(model_dir)


def sampling_cost(engines: list[str], model_dir: Path, params: int, args: argparse.Namespace,
                  core: set[int] | None) -> None:
    """Per engine and round: the bare engine unseeded, seeded, unseeded again; prints the ratio."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ratios: dict[str, list[float]] = {kind: [] for kind in engines}
    rows = []
    for round_ in range(args.rounds):
        for kind in engines:
            runs = [run_bare(kind, model_dir, args, core, sampling=sampling)
                    for sampling in ("unseeded", "seeded", "unseeded")]
            unseeded = (runs[0]["tokens_per_s"] + runs[2]["tokens_per_s"]) / 2
            ratios[kind].append(runs[1]["tokens_per_s"] / unseeded)
            rows.append((round_ + 1, kind, runs, unseeded))
    where = f"alone on core {sorted(core)[0]}" if core else "unpinned"
    print(f"\nseeded sampling's cost: a Qwen3 of {params / 1e6:.2f}M parameters (hidden {args.hidden_size}, "
          f"{args.layers} layers, vocabulary {vocab}, float32), {args.prompts} arith prompts x {args.group_size} "
          f"samples x <= {args.max_new_tokens} new tokens per batch, T=1, top_p=1; {args.seconds:.0f} s windows; "
          f"{os.cpu_count()} CPU cores ({cpu_model()}), each engine {where}, 1 thread")
    print(f"{'round':<7}{'engine':<14}{'unseeded tokens/s':>19}{'seeded tokens/s':>17}{'unseeded again':>16}"
          f"{'seeded / unseeded':>19}{'tokens/rollout':>16}{'steal s':>16}")
    for round_, kind, runs, unseeded in rows:
        steal = ", ".join(f"{r['steal_s']:.1f}" for r in runs)
        print(f"{round_:<7}{kind:<14}{runs[0]['tokens_per_s']:>19.0f}{runs[1]['tokens_per_s']:>17.0f}"
              f"{runs[2]['tokens_per_s']:>16.0f}{runs[1]['tokens_per_s'] / unseeded:>19.3f}"
              f"{runs[1]['tokens_per_rollout']:>16.1f}{steal:>16}")
    print("(seeded / unseeded: the seeded run against the mean of the unseeded runs either side of it; unseeded: "
          "the engine's own generator; steal s: the hypervisor's, per run)")
    for kind in engines:
        mean = sum(ratios[kind]) / len(ratios[kind])
        print(f"{kind}: seeded / unseeded generation tokens/s, by round: {', '.join(f'{r:.3f}' for r in ratios[kind])}; "
              f"mean {mean:.3f} (target >= 0.95)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=None,
                        help="comma-separated; default: transformers, plus vllm where it imports")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window of each run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch (= per lease)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--warmup-batches", type=int, default=3, help="batches (leases) left out of the rate")
    parser.add_argument("--publish-every", type=int, default=1, help="kappa of the swarm's learner")
    parser.add_argument("--staleness", type=int, default=2, help="S of the swarm's learner")
    parser.add_argument("--hidden-size", type=int, default=128, help="model width (128: the tiny model, ~300k params)")
    parser.add_argument("--layers", type=int, default=2, help="model depth (2: the tiny model)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="vLLM KV cache (CPU)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--device", default="cpu", help="torch device of the transformers engine and the learner "
                        "(cpu, cuda, cuda:N); vLLM picks its own")
    parser.add_argument("--layout", choices=("engine-core", "one-core", "in-thread"), default="engine-core",
                        help="where the peer runs. engine-core: its engine process alone on the bare engine's core "
                        "(engine.cpus), the daemon beside the learner; one-core: daemon and engine process share "
                        "that core; in-thread: the engine in a thread of the daemon (engine.isolate = false), "
                        "sharing that core")
    parser.add_argument("--rounds", type=int, default=1, help="bare / swarm / bare sequences per engine; the ratio "
                        "is reported per round and averaged (one round moves by ~5-10 %% on a shared VM)")
    parser.add_argument("--bare-beside", choices=("both", "learner", "idle"), default="both",
                        help="what runs on the other core during the bare engine's runs: a learner stand-in (the "
                        "peer is compared with these runs), nothing, or both in turn (default)")
    parser.add_argument("--no-paced", action="store_true", help="skip the bare run paced like the peer (idle the "
                        "share of the window the learner left the peer idle)")
    parser.add_argument("--sampling", choices=("seeded", "unseeded"), default="seeded",
                        help="how the bare engine samples: with the leases' seeded sampler (what a rollout peer "
                        "does), or with the engine's own generator")
    parser.add_argument("--sampling-cost", action="store_true", help="only the bare engines, unseeded / seeded / "
                        "unseeded per round: what the seeded sampler costs (no swarm)")
    parser.add_argument("--vocab-size", type=int, default=None, help="widen the model's logits to this many "
                        "entries (default: the tiny tokenizer's 49; Qwen3: 151936)")
    parser.add_argument("--bare", help=argparse.SUPPRESS)
    parser.add_argument("--idle-share", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--learner-load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0.0 <= args.idle_share < 1.0:
        parser.error(f"--idle-share must be in [0, 1), got {args.idle_share}")
    args.passthrough = [f"--seconds={args.seconds}", f"--prompts={args.prompts}", f"--group-size={args.group_size}",
                        f"--max-new-tokens={args.max_new_tokens}", f"--warmup-batches={args.warmup_batches}",
                        f"--kv-cache-gib={args.kv_cache_gib}", f"--device={args.device}"]
    if args.bare:
        print(json.dumps(bare(args.bare, args.model, args)))
        return
    if args.learner_load:
        learner_load(args.model, args)
        return

    from safetensors.torch import load_file

    from echo2swarm.models.tiny import write_tiny_model
    from echo2swarm.rollout.engines import vllm_installed

    engines = args.engines.split(",") if args.engines else ["transformers", *(["vllm"] if vllm_installed() else [])]
    cores = sorted(os.sched_getaffinity(0))
    split = None if args.no_pin or len(cores) < 2 else ({cores[0]}, {cores[-1]})
    results: dict[str, list[dict[str, dict[str, Any]]]] = {kind: [] for kind in engines}
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp, pinned(split[0] if split else None):
        model_dir = write_tiny_model(Path(tmp) / "model", seed=0, hidden_size=args.hidden_size,
                                     num_layers=args.layers)
        if args.vocab_size is not None:
            widen_vocabulary(model_dir, args.vocab_size)
        params = sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())
        engine_core, learner_core = (split[1], split[0]) if split else (None, None)
        if args.sampling_cost:
            sampling_cost(engines, model_dir, params, args, engine_core)
            return
        besides = {"both": ["idle", "learner"], "learner": ["learner"], "idle": ["idle"]}[args.bare_beside]
        if learner_core is None:
            besides = ["idle"]

        def bare_runs(kind: str, model: Path, order: list[str]) -> dict[str, dict[str, Any]]:
            runs = {}
            for beside in order:
                with beside_learner(learner_core if beside == "learner" else None, model_dir, args):
                    runs[beside] = run_bare(kind, model, args, engine_core)
            return runs

        for round_ in range(args.rounds):
            for kind in engines:
                # Bare before and after the swarm run, on the same core: a shared VM's speed drifts by
                # 10-20% between minutes, so the swarm run is compared with the mean of the two. The
                # runs beside the learner stand-in are the ones next to the swarm run in time.
                before = bare_runs(kind, model_dir, besides)
                swarm = run_swarm(kind, model_dir, Path(tmp) / f"swarm-{kind}-{round_}", args, split, args.layout)
                after = bare_runs(kind, swarm["trained_model"], besides[::-1])
                paced = None
                idle_share = swarm["wait_s"] / swarm["seconds"]
                if not args.no_paced and idle_share >= 0.05:
                    # The peer computed in bursts between the learner's steps; a tiny model's speed
                    # depends on its weights staying in the core's caches, which idling loses.
                    with beside_learner(learner_core if besides[-1] == "learner" else None, model_dir, args):
                        paced = run_bare(kind, swarm["trained_model"], args, engine_core, min(idle_share, 0.9))
                    paced["idle_share"] = idle_share
                shutil.rmtree(Path(tmp) / f"swarm-{kind}-{round_}", ignore_errors=True)
                bares = {}
                for beside in besides:
                    b, a = before[beside], after[beside]
                    bares[beside] = {**b, "tokens_per_s": (b["tokens_per_s"] + a["tokens_per_s"]) / 2,
                                     "runs": [b["tokens_per_s"], a["tokens_per_s"]],
                                     "lengths": [b["tokens_per_rollout"], a["tokens_per_rollout"]],
                                     "steals": [b["steal_s"], a["steal_s"]]}
                results[kind].append({"bare": bares[besides[-1]], "bare_idle": bares.get("idle"), "paced": paced,
                                      "beside": besides[-1], "swarm": swarm})

    where = f"each engine alone on core {split[1]}" if split else "unpinned"
    print(f"\nrollout engines on a Qwen3 of {params / 1e6:.2f}M parameters (hidden {args.hidden_size}, "
          f"{args.layers} layers, float32): {args.prompts} arith prompts x {args.group_size} samples x "
          f"<= {args.max_new_tokens} new tokens per batch/lease, T=1; {args.seconds:.0f} s windows; "
          f"{os.cpu_count()} CPU cores ({cpu_model()}), {where}, 1 thread; peer layout {args.layout}; "
          f"swarm: kappa={args.publish_every}, S={args.staleness}")
    for round_ in range(args.rounds):
        print(f"\n== round {round_ + 1} of {args.rounds}")
        report({kind: results[kind][round_] for kind in engines}, args)
    print("\n== summary")
    if "vllm" in results and "transformers" in results:
        ratios = [v["bare"]["tokens_per_s"] / t["bare"]["tokens_per_s"]
                  for v, t in zip(results["vllm"], results["transformers"])]
        print(f"vllm / transformers, bare tokens/s: {', '.join(f'{r:.2f}' for r in ratios)}")
    for kind in engines:
        busy = [r["swarm"]["busy_tokens_per_s"] / r["bare"]["tokens_per_s"] for r in results[kind]]
        share = [computing_share(r["swarm"]) for r in results[kind]]
        beside = "the learner stand-in" if results[kind][0]["beside"] == "learner" else "an idle core"
        print(f"{kind}: rollout peer through the swarm / bare engine beside {beside}, busy tokens/s, by round: "
              f"{', '.join(f'{b:.2f}' for b in busy)}; mean {sum(busy) / len(busy):.2f} (target >= 0.95)")
        if results[kind][0]["beside"] == "learner" and results[kind][0]["bare_idle"]:
            idle = [r["swarm"]["busy_tokens_per_s"] / r["bare_idle"]["tokens_per_s"] for r in results[kind]]
            neighbour = [r["bare"]["tokens_per_s"] / r["bare_idle"]["tokens_per_s"] for r in results[kind]]
            print(f"{kind}: the same against the bare engine beside an idle core: "
                  f"{', '.join(f'{b:.2f}' for b in idle)}; mean {sum(idle) / len(idle):.2f} (bare beside the "
                  f"learner stand-in / beside an idle core: {', '.join(f'{b:.2f}' for b in neighbour)})")
        paced = [(r["paced"], r["swarm"], r["bare"]) for r in results[kind] if r["paced"] is not None]
        if paced:
            slowed = [p_["computing_tokens_per_s"] / b_["tokens_per_s"] for p_, _, b_ in paced]
            peer = [s_["busy_tokens_per_s"] / p_["computing_tokens_per_s"] for p_, s_, _ in paced]
            print(f"{kind}: the bare engine paced like the peer / back to back, while computing, by round: "
                  f"{', '.join(f'{x:.2f}' for x in slowed)}; the peer / the paced bare engine, busy tokens/s: "
                  f"{', '.join(f'{x:.2f}' for x in peer)}; mean {sum(peer) / len(peer):.2f}")
        if all(x is not None for x in share):
            print(f"{kind}: share of the busy window the engine spent generating, by round: "
                  f"{', '.join(f'{100 * x:.1f} %' for x in share)} (the rest: weight loads, round trips not hidden)")


def computing_share(s: dict[str, Any]) -> float | None:
    """Seconds the engine process generated / seconds the peer had work: the swarm's overhead, free of the
    VM's speed drift (both sides of the ratio are the same window)."""
    if not s["host_busy_s"]:
        return None
    return s["host_busy_s"]["generate"] / max(s["seconds"] - s["wait_s"], 1e-9)


def report(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    engines = list(results)
    print(f"{'engine':<14}{'run':<34}{'tokens/s':>10}{'busy tokens/s':>15}{'idle s':>8}{'versions':>10}"
          f"{'refit ms':>10}{'tokens/rollout':>16}")
    for kind in engines:
        b, s = results[kind]["bare"], results[kind]["swarm"]
        rows = [("idle", results[kind]["bare_idle"])] if results[kind]["beside"] == "learner" else []
        rows = [(beside, bare_) for beside, bare_ in [*rows, (results[kind]["beside"], b)] if bare_ is not None]
        for index, (beside, bare_) in enumerate(rows):
            label = ("bare, {}: {:.0f}, {:.0f}".format("beside learner" if beside == "learner" else "core 0 idle",
                                                        *bare_["runs"]))
            lengths = "{:.1f}, {:.1f}".format(*bare_["lengths"])
            name = kind if index == 0 else ""
            print(f"{name:<14}{label:<34}{bare_['tokens_per_s']:>10.0f}{bare_['tokens_per_s']:>15.0f}{'':>28}"
                  f"{lengths:>16}")
        paced = results[kind].get("paced")
        if paced is not None:
            label = f"bare, paced, idle {100 * paced['idle_share']:.0f} %"
            print(f"{'':<14}{label:<34}{paced['tokens_per_s']:>10.0f}{paced['computing_tokens_per_s']:>15.0f}"
                  f"{paced['idle_s']:>8.1f}{'':>20}"
                  f"{paced['tokens_per_rollout']:>16.1f}")
        refit = f"{s['refit_s'] * 1000:.0f}" if s.get("refit_s") is not None else "-"
        label = f"rollout peer, swarm ({args.layout})"
        print(f"{'':<14}{label:<34}{s['tokens_per_s']:>10.0f}{s['busy_tokens_per_s']:>15.0f}"
              f"{s['wait_s']:>8.1f}{s['versions']:>10}{refit:>10}{s['tokens_per_rollout']:>16.1f}")
    print("(bare: the mean of a run before the swarm run, on the initial weights, and one after it, on the peer's "
          "last version; beside learner: the learner stand-in busy on the other core; idle s: the learner had no "
          "work for the peer, left out of busy tokens/s; paced: on the peer's last version, idle after each batch "
          "for the share of the window the peer was, busy tokens/s over its computing seconds)")
    for kind in engines:
        b, s = results[kind]["bare"], results[kind]["swarm"]
        print(f"{kind} peer, seconds of the {s['seconds']:.1f} s window: " + ", ".join(
            f"{name.removesuffix('_s')} {value:.1f}" for name, value in s["split"].items()))
        if s["host_busy_s"]:
            busy = s["host_busy_s"]
            print(f"{kind} peer, seconds its engine process computed: generate {busy['generate']:.1f} "
                  f"({s['tokens_per_s'] * s['seconds'] / max(busy['generate'], 1e-9):.0f} tokens/s), "
                  f"load weights {busy['load']:.2f}")
        learning = s["learning"]
        print(f"{kind} peer, batches in the window: {s['rollouts_per_batch']:.1f} rollouts each on average "
              f"(bare: {args.prompts * args.group_size}; a lease is smaller when the learner needs fewer prompts)")
        print(f"{kind} peer, weight loads in the window: {s['refits']} (versions left for a newer one: "
              f"{s['refits_deferred']}); learner over the whole run: {learning['steps']} steps, trained groups' mean "
              f"staleness {learning['mean_staleness']:.2f} (S={args.staleness}), {learning['dropped_stale']} of "
              f"{learning['accepted']} accepted groups dropped as too stale, refused: {learning['refused'] or 'none'}")
        print(f"{kind} peer, CPU seconds by process: " + ", ".join(
            f"{name} {value:.1f}" for name, value in sorted(s["cpu"].items(), key=lambda kv: -kv[1])))
        print(f"{kind}: seconds the VM's hypervisor took from the engine's core (steal): bare runs "
              f"{b['steals'][0]:.1f} and {b['steals'][1]:.1f} of {args.seconds:.0f} s, swarm window {s['steal_s']:.1f}")
    print("(generate: a batch in the engine; starved: engine idle on a round trip; version_wait: waiting for a "
          "lease's version; lease/submit round trips overlap generation)")
    for kind in engines:
        s, b = results[kind]["swarm"], results[kind]["bare"]["tokens_per_s"]
        beside = "the learner stand-in" if results[kind]["beside"] == "learner" else "an idle core"
        print(f"{kind}: rollout peer through the swarm / bare engine beside {beside}, busy "
              f"tokens/s: {s['busy_tokens_per_s'] / b:.2f} "
              f"(target >= 0.95); over the whole window: {s['tokens_per_s'] / b:.2f}; while generating: "
              f"{s['tokens_per_s'] * s['seconds'] / max(s['split']['generate_s'], 1e-9) / b:.2f}")
        paced = results[kind].get("paced")
        if paced is not None:
            print(f"{kind}: the bare engine paced like the peer / back to back, while computing: "
                  f"{paced['computing_tokens_per_s'] / b:.2f}; the peer / the paced bare engine, busy tokens/s: "
                  f"{s['busy_tokens_per_s'] / paced['computing_tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Learner memory per rank and step time at W = 1 and W = 2 ranks (FSDP2), and the largest model a
memory budget per rank holds.

    python scripts/bench_learner.py [--device cpu] [--ranks 1,2] [--hidden 1024 --layers 8 --heads 16]
                                    [--budget-gib 80] [--json]
    python scripts/bench_learner.py --device cuda --ranks 1 --fsdp-w1   # one GPU: plain and FSDP2 (bf16)

Builds a Qwen3 of the asked shape (echo2swarm.models.tiny: character vocabulary, random weights)
in a temporary directory, then for each W runs W fresh processes (torch.multiprocessing, gloo on
the CPU, NCCL + gloo on CUDA; W = 1 is the plain single-process GRPOTrainer, `--fsdp-w1` adds
W = 1 through the sharded trainer) that train `--warmup` steps (AdamW state created), then
`--steps` measured steps on a synthetic batch (random tokens, verification off):

- peak memory per rank over the measured steps: CUDA `max_memory_allocated`; on the CPU `trainer`:
  the peak anonymous resident set (RssAnon, sampled every 5 ms: tensors and heap, not libtorch's
  mapped code) less its value before the model was built (Python, torch, the batch: the same at
  every W), and the peak resident set (VmHWM, reset after the warm-up) for reference;
- `state`: the bytes of the rank's own parameters, gradients and AdamW moments (exact);
- median step seconds.

Ratios W / W=1 are printed in the same run. `bytes/param` is each rank's measured trainer memory
over the parameter count; the budget line applies it to Qwen3 shapes (0.6B .. 32B with their real
vocabulary) at each measured W: the largest that fits `--budget-gib` per rank (activations scale
with the batch, not the parameters, so this holds for batches like the measured one).

Runs where only torch, transformers, safetensors, tokenizers and pydantic are installed (nothing
here imports hivemind or aiohttp). The tiny vocabulary keeps the LM head negligible; positions are
capped at 128.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from echo2swarm.config.rl import TrainConfig, VerifyConfig  # noqa: E402
from echo2swarm.train.group import Group  # noqa: E402
from echo2swarm.models.tiny import MAX_POSITIONS, build_tiny_model  # noqa: E402

FIRST_CHAR_ID = 4  # ids 0..3 are <pad> <bos> <eos> <unk>
GIB = 2**30
# Qwen3 dense shapes (hidden, layers, heads, kv heads, intermediate), vocabulary 151936, tied below 4B.
QWEN3_SHAPES = {
    "Qwen3-0.6B": (1024, 28, 16, 8, 3072, True), "Qwen3-1.7B": (2048, 28, 16, 8, 6144, True),
    "Qwen3-4B": (2560, 36, 32, 8, 9728, True), "Qwen3-8B": (4096, 36, 32, 8, 12288, False),
    "Qwen3-14B": (5120, 40, 40, 8, 17408, False), "Qwen3-32B": (5120, 64, 64, 8, 25600, False),
}


def qwen3_params(hidden: int, layers: int, heads: int, kv: int, inter: int, tied: bool, vocab: int = 151936) -> int:
    head_dim = 128
    attention = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2 + 2 * head_dim
    layer = attention + 3 * hidden * inter + 2 * hidden
    return layers * layer + vocab * hidden * (1 if tied else 2) + hidden


def rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """The largest anonymous resident set (RssAnon: heap and tensors, not the mapped code of
    libtorch) seen while running, sampled every `period_s` on a thread."""

    def __init__(self, period_s: float = 0.005):
        self.period_s, self.peak = period_s, rss_bytes("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, rss_bytes("RssAnon"))

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes("RssAnon"))


def reset_peak_rss() -> None:
    """Release freed heap to the OS, then reset VmHWM to the current resident set (Linux)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def state_bytes(trainer: Any) -> int:
    """Bytes of this rank's own parameters, gradients and AdamW state (a DTensor's local shard)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in trainer.model.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for state in trainer.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += local(value).numel() * local(value).element_size()
    return total


def synthetic_groups(vocab: int, args: argparse.Namespace) -> list[Group]:
    rng = random.Random(0)
    groups = []
    for g in range(args.groups):
        completions = [[rng.randrange(FIRST_CHAR_ID, vocab) for _ in range(args.completion_len)]
                       for _ in range(args.group_size)]
        groups.append(Group(
            prompt_id=f"bench-{g}", version=1,
            prompt_ids=[rng.randrange(FIRST_CHAR_ID, vocab) for _ in range(args.prompt_len)],
            completions=completions, behaviour_logprobs=[[-rng.uniform(3.0, 4.5) for _ in c] for c in completions],
            rewards=[float(rng.random() < 0.5) for _ in completions], finish_reasons=["length"] * args.group_size,
        ))
    return groups


def rank_main(rank: int, world: int, sharded: bool, port: int, model_dir: str, args: argparse.Namespace,
              results: Any) -> None:
    """One rank of one W: build, warm up, measure; rank r puts its figures on `results`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # Imported before the baseline at every W: modules are not what the ranks split.
    import torch.distributed.checkpoint  # noqa: F401

    from echo2swarm.train.distributed import ShardedTrainer, init_ranks
    from echo2swarm.train.trainer import GRPOTrainer

    config = TrainConfig(device=args.device, lr=1e-5, group_size=args.group_size, max_new_tokens=args.completion_len,
                         ppo_epochs=args.ppo_epochs, minibatches=args.minibatches,
                         micro_batch_sequences=args.micro_batch, mixed_precision=args.mixed_precision,
                         activation_checkpointing=args.activation_checkpointing, threads=args.threads)
    unverified = VerifyConfig(enabled=False)
    groups = synthetic_groups(int(args.vocab), args)
    baseline, baseline_anon = rss_bytes("VmRSS"), rss_bytes("RssAnon")
    if sharded:
        trainer: Any = ShardedTrainer(Path(model_dir), config, ranks=init_ranks(args.device), verify=unverified)
    else:
        trainer = GRPOTrainer(Path(model_dir), config, verify=unverified)
    device = trainer.device
    cuda = device.type == "cuda"

    def run_step() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        # Every rank calls the base step itself (no command loop here): same batch, same collectives.
        GRPOTrainer.step(trainer, groups, current_version=1)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    built = rss_bytes("VmRSS")
    for _ in range(args.warmup):
        run_step()
    warm = rss_bytes("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        cuda_base = torch.cuda.memory_allocated(device)
    reset_peak_rss()
    with AnonPeak() as anon:
        times = [run_step() for _ in range(args.steps)]
    row: dict[str, Any] = {
        "rank": rank, "step_s": statistics.median(times),
        "peak_rss_gib": rss_bytes("VmHWM") / GIB, "trainer_gib": (anon.peak - baseline_anon) / GIB,
        "rss_over_baseline_gib": (rss_bytes("VmHWM") - baseline) / GIB,
        "state_gib": state_bytes(trainer) / GIB, "built_gib": (built - baseline) / GIB,
        "warm_gib": (warm - baseline) / GIB, "baseline_gib": baseline / GIB,
    }
    if cuda:
        row.update(peak_gib=torch.cuda.max_memory_allocated(device) / GIB, resident_gib=cuda_base / GIB,
                   device_name=torch.cuda.get_device_name(device))
        row["trainer_gib"] = row["peak_gib"]
    results.put(row)
    if sharded:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(world: int, sharded: bool, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, sharded, port, str(model_dir), args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = []
    deadline = time.monotonic() + args.timeout_s
    while len(rows) < world:
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            raise SystemExit(f"W={world}: a rank failed or ran past --timeout-s (exit codes "
                             f"{[p.exitcode for p in procs]})")
        try:
            rows.append(results.get(timeout=1.0))
        except Exception:
            continue
    for p in procs:
        p.join(timeout=60)
    rows.sort(key=lambda r: r["rank"])
    worst = max(rows, key=lambda r: r["trainer_gib"])
    return {"world": world, "sharded": sharded, "step_s": max(r["step_s"] for r in rows),
            "state_gib": max(r["state_gib"] for r in rows),
            "trainer_gib": worst["trainer_gib"], "peak_rss_gib": max(r["peak_rss_gib"] for r in rows),
            "peak_gib": worst.get("peak_gib"), "device_name": rows[0].get("device_name"), "ranks": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, or auto/cuda (each rank on cuda:RANK)")
    parser.add_argument("--ranks", default="1,2", help="comma-separated world sizes to measure (default 1,2)")
    parser.add_argument("--fsdp-w1", action="store_true", help="also W=1 through the sharded (FSDP2) trainer")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (the tiny default is 128)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16, help="attention heads (a multiple of 2 dividing --hidden)")
    parser.add_argument("--groups", type=int, default=4, help="groups (prompts) per step")
    parser.add_argument("--group-size", type=int, default=4, help="completions per group")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--ppo-epochs", type=int, default=2)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=None, help="train.micro_batch_sequences")
    parser.add_argument("--mixed-precision", choices=["auto", "bf16", "off"], default="auto")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps before measuring (creates AdamW state)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per rank")
    parser.add_argument("--budget-gib", type=float, default=80.0, help="memory per rank for the budget line")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="give up on one W after this long")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    if args.prompt_len + args.completion_len > MAX_POSITIONS:
        parser.error(f"prompt + completion is {args.prompt_len + args.completion_len} tokens; the model has "
                     f"{MAX_POSITIONS} positions")
    worlds = [int(w) for w in args.ranks.split(",") if w.strip()]
    if not worlds or min(worlds) < 1:
        parser.error("--ranks: world sizes >= 1, e.g. 1,2")
    if args.device != "cpu" and torch.cuda.is_available() and max(worlds) > torch.cuda.device_count():
        parser.error(f"--ranks {args.ranks}: only {torch.cuda.device_count()} CUDA device(s); one rank per device")

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        model_dir = Path(tmp) / "model"
        model, tokenizer = build_tiny_model(seed=0, hidden_size=args.hidden, num_layers=args.layers,
                                            num_heads=args.heads)
        params = model.num_parameters()
        args.vocab = model.config.vocab_size
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del model
        plan = [(w, w > 1) for w in worlds] + ([(1, True)] if args.fsdp_w1 and 1 in worlds else [])
        for world, sharded in plan:
            runs.append(measure(world, sharded, model_dir, args))

    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("hivemind", "aiohttp"))
    assert not leaked, f"bench_learner must not import {leaked}"
    base = next((r for r in runs if r["world"] == 1 and not r["sharded"]), runs[0])
    for r in runs:
        r["bytes_per_param"] = r["trainer_gib"] * GIB / params
        r["memory_ratio"] = r["trainer_gib"] / base["trainer_gib"]
        r["state_ratio"] = r["state_gib"] / base["state_gib"]
        r["rss_ratio"] = r["peak_rss_gib"] / base["peak_rss_gib"]
        r["time_ratio"] = r["step_s"] / base["step_s"]
        fits = [(name, qwen3_params(*shape)) for name, shape in QWEN3_SHAPES.items()
                if qwen3_params(*shape) * r["bytes_per_param"] <= args.budget_gib * GIB]
        r["budget_max_params"] = int(args.budget_gib * GIB / r["bytes_per_param"])
        r["budget_largest_qwen3"] = fits[-1][0] if fits else None
    report = {
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "params": params},
        "batch": {"groups": args.groups, "group_size": args.group_size, "prompt_len": args.prompt_len,
                  "completion_len": args.completion_len, "ppo_epochs": args.ppo_epochs,
                  "minibatches": args.minibatches, "micro_batch": args.micro_batch},
        "device": args.device, "mixed_precision": args.mixed_precision, "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "budget_gib": args.budget_gib, "runs": runs,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"Qwen3 (tiny vocabulary): hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
          f"{params / 1e6:.1f}M params; torch {torch.__version__}; device {args.device}"
          f"{' (' + base['device_name'] + ')' if base.get('device_name') else ''}")
    print(f"batch: {args.groups}x{args.group_size} sequences of {args.prompt_len}+{args.completion_len} tokens, "
          f"{args.ppo_epochs}x{args.minibatches} updates a step, micro-batch {args.micro_batch or '-'}; "
          f"median of {args.steps} steps after {args.warmup}")
    memory = "peak GiB" if args.device != "cpu" else "trainer GiB"
    print(f"{'W':>3} {'trainer':<8}{'step s':>9}{memory:>13}{'peak RSS GiB':>14}{'state GiB':>11}{'B/param':>9}"
          f"{'mem xW1':>9}{'state xW1':>11}{'time xW1':>10}  largest Qwen3 in {args.budget_gib:g} GiB/rank")
    for r in runs:
        print(f"{r['world']:>3} {'fsdp2' if r['sharded'] else 'plain':<8}{r['step_s']:>9.3f}{r['trainer_gib']:>13.3f}"
              f"{r['peak_rss_gib']:>14.3f}{r['state_gib']:>11.3f}{r['bytes_per_param']:>9.1f}{r['memory_ratio']:>9.2f}"
              f"{r['state_ratio']:>11.2f}{r['time_ratio']:>10.2f}"
              f"  {r['budget_largest_qwen3'] or 'none'} (<= {r['budget_max_params'] / 1e9:.1f}B params)")
    print("per rank (GiB over the process's resident set before the model was built):")
    for r in runs:
        for row in r["ranks"]:
            print(f"  W={r['world']} {'fsdp2' if r['sharded'] else 'plain'} rank {row['rank']}: built "
                  f"{row['built_gib']:.3f}, after warm-up {row['warm_gib']:.3f}, peak in steps {row['trainer_gib']:.3f}"
                  f", params+grads+AdamW {row['state_gib']:.3f} (process before the model {row['baseline_gib']:.3f})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Learner step and transformers-engine generation on a GPU (and the CPU), no swarm involved.

    python scripts/bench_gpu.py [--device auto] [--also-cpu] [--hidden 1024 --layers 8 --heads 16] [--json]

Builds a tiny-architecture Qwen3 (echo2swarm.models.tiny, character tokenizer, random weights)
of the size asked for in a temporary directory, then on each device:

(a) train: GRPOTrainer.step on a synthetic batch of --groups groups x --group-size completions of
    --completion-len tokens after a --prompt-len prompt (random ids, rewards and behaviour
    logprobs; --stale adds the decoupled-PPO forward pass). Median seconds over --steps steps
    after --warmup; tokens/s counts prompt + completion tokens of the batch.
(b) generate: TransformersEngine.generate on --gen-prompts prompts x --gen-n samples of at most
    --gen-tokens new tokens (temperature 1). Median over --gen-repeats after one warm-up;
    tokens/s counts the completion tokens actually produced (a random model stops early at times).

Runs where only torch, transformers, safetensors, tokenizers and pydantic are installed: nothing
imported here pulls in hivemind or aiohttp (checked at the end of main). The tiny model's
vocabulary has 49 symbols, so the LM head costs next to nothing; positions are capped at 128.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from echo2swarm.config.rl import TrainConfig  # noqa: E402
from echo2swarm.train.group import Group  # noqa: E402
from echo2swarm.train.trainer import GRPOTrainer  # noqa: E402
from echo2swarm.models.tiny import MAX_POSITIONS, build_tiny_model  # noqa: E402
from echo2swarm.rollout.engines.base import SamplingParams  # noqa: E402
from echo2swarm.rollout.engines.hf import TransformersEngine  # noqa: E402
from echo2swarm.runtime.devices import resolve_device  # noqa: E402

FIRST_CHAR_ID = 4  # ids 0..3 are <pad> <bos> <eos> <unk>


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_groups(vocab: int, args: argparse.Namespace, version: int) -> list[Group]:
    rng = random.Random(0)
    groups = []
    for g in range(args.groups):
        completions = [[rng.randrange(FIRST_CHAR_ID, vocab) for _ in range(args.completion_len)]
                       for _ in range(args.group_size)]
        groups.append(Group(
            prompt_id=f"bench-{g}", version=version,
            prompt_ids=[rng.randrange(FIRST_CHAR_ID, vocab) for _ in range(args.prompt_len)],
            completions=completions,
            behaviour_logprobs=[[-rng.uniform(3.0, 4.5) for _ in c] for c in completions],
            rewards=[float(rng.random() < 0.5) for _ in completions],
            finish_reasons=["length"] * args.group_size,
        ))
    return groups


def bench_train(model_dir: Path, device: str, args: argparse.Namespace) -> dict[str, Any]:
    trainer = GRPOTrainer(model_dir, TrainConfig(device=device, threads=args.threads, lr=1e-5,
                                                 group_size=args.group_size, max_new_tokens=args.completion_len))
    groups = synthetic_groups(trainer.vocab_size, args, version=0 if args.stale else 1)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    tokens = args.groups * args.group_size * (args.prompt_len + args.completion_len)
    times = []
    for i in range(args.warmup + args.steps):
        sync(trainer.device)
        started = time.perf_counter()
        trainer.step(groups, current_version=1)
        sync(trainer.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    median = statistics.median(times)
    memory = torch.cuda.max_memory_allocated(trainer.device) / 2**30 if trainer.device.type == "cuda" else None
    del trainer
    return {"step_s": median, "train_tokens_per_s": tokens / median, "sequences": args.groups * args.group_size,
            "batch_tokens": tokens, "peak_gib": memory}


def bench_generate(model_dir: Path, device: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = TransformersEngine(model_dir, device=device, threads=args.threads,
                                max_batch_sequences=args.gen_prompts * args.gen_n)
    rng = random.Random(1)
    chars = "0123456789+"
    prompts = ["".join(rng.choice(chars) for _ in range(args.prompt_len - 1)) + "=" for _ in range(args.gen_prompts)]
    times, produced = [], []
    for i in range(1 + args.gen_repeats):
        sync(engine.device)
        started = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(n=args.gen_n, max_new_tokens=args.gen_tokens, seed=i))
        sync(engine.device)
        if i >= 1:
            times.append(time.perf_counter() - started)
            produced.append(sum(len(c.token_ids) for g in groups for c in g))
    engine.close()
    rates = [n / t for n, t in zip(produced, times)]
    return {"generate_s": statistics.median(times), "gen_tokens_per_s": statistics.median(rates),
            "gen_tokens": statistics.median(produced), "gen_sequences": args.gen_prompts * args.gen_n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto (cuda when visible, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--also-cpu", action="store_true", help="measure on the CPU too, for comparison")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (the tiny default is 128)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16, help="attention heads (a multiple of 2 dividing --hidden)")
    parser.add_argument("--groups", type=int, default=16, help="train: groups (prompts) per step")
    parser.add_argument("--group-size", type=int, default=8, help="train: completions per group")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (train and generate)")
    parser.add_argument("--completion-len", type=int, default=48, help="train: completion tokens")
    parser.add_argument("--stale", action="store_true", help="train: stale groups (adds the proximal forward pass)")
    parser.add_argument("--steps", type=int, default=10, help="train: measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="train: steps left out of the median")
    parser.add_argument("--gen-prompts", type=int, default=16, help="generate: prompts per batch")
    parser.add_argument("--gen-n", type=int, default=8, help="generate: samples per prompt")
    parser.add_argument("--gen-tokens", type=int, default=48, help="generate: max new tokens")
    parser.add_argument("--gen-repeats", type=int, default=3, help="generate: measured batches")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    for length in (args.prompt_len + args.completion_len, args.prompt_len + args.gen_tokens):
        if length > MAX_POSITIONS:
            parser.error(f"prompt + completion is {length} tokens; the tiny model has {MAX_POSITIONS} positions")
    if args.prompt_len < 2:
        parser.error("--prompt-len must be >= 2")

    devices = [resolve_device(args.device, setting="--device")]
    if args.also_cpu and devices[0].type != "cpu":
        devices.append(torch.device("cpu"))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        model_dir = Path(tmp) / "model"
        model, tokenizer = build_tiny_model(seed=0, hidden_size=args.hidden, num_layers=args.layers,
                                            num_heads=args.heads)
        params = model.num_parameters()
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del model
        for device in devices:
            name = str(device)
            row: dict[str, Any] = {"device": name}
            if device.type == "cuda":
                row["device_name"] = torch.cuda.get_device_name(device)
            row.update(bench_train(model_dir, name, args))
            row.update(bench_generate(model_dir, name, args))
            results.append(row)

    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("hivemind", "aiohttp"))
    assert not leaked, f"bench_gpu must not import {leaked}"
    report = {
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "params": params},
        "train_batch": {"groups": args.groups, "group_size": args.group_size, "prompt_len": args.prompt_len,
                        "completion_len": args.completion_len, "stale": args.stale, "steps": args.steps},
        "generate_batch": {"prompts": args.gen_prompts, "n": args.gen_n, "max_new_tokens": args.gen_tokens},
        "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"tiny Qwen3: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {params / 1e6:.1f}M params; "
          f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(f"train: {args.groups}x{args.group_size} sequences of {args.prompt_len}+{args.completion_len} tokens"
          f"{' (stale)' if args.stale else ''}, median of {args.steps} steps; generate: {args.gen_prompts}x"
          f"{args.gen_n} samples, <= {args.gen_tokens} new tokens, median of {args.gen_repeats}")
    print(f"{'device':<10}{'step s':>10}{'train tok/s':>14}{'gen s':>10}{'gen tok/s':>12}{'peak GiB':>10}")
    for r in results:
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"{r['device']:<10}{r['step_s']:>10.3f}{r['train_tokens_per_s']:>14.0f}{r['generate_s']:>10.3f}"
              f"{r['gen_tokens_per_s']:>12.0f}{peak:>10}")
    if len(results) == 2:
        gpu, cpu = results
        print(f"speed-up {gpu['device']} / cpu: train x{cpu['step_s'] / gpu['step_s']:.1f}, "
              f"generate x{gpu['gen_tokens_per_s'] / cpu['gen_tokens_per_s']:.1f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""One GRPO step on one process: the proximal forward reused as the first update's (what the learner
does with one minibatch) against a forward of the first update's own (the baseline), in one run.

    python scripts/bench_step.py [--groups 16 --group-size 8 --prompt-len 8 --completion-len 4]
                                 [--hidden 128 --layers 2 --heads 4] [--ppo-epochs 2] [--steps 20] [--json]

The defaults are the demo's step (the tiny model, 16 prompts x 8 completions of 4 tokens, two
passes). Both trainers start from the same weights and train the same batch, its behaviour
logprobs the policy's own (verification on, as in a learner at staleness 0, but for the typicality
test: random tokens are atypical text); the baseline differs
only in `train.micro_batch_sequences` = the batch's rows, one micro-batch, which gives the first
update a forward of its own. Steps alternate between the two, so drift in the machine's load hits
both; medians and their ratio are printed, with the policy forwards each step made.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.models.tiny import MAX_POSITIONS, write_tiny_model
from echo2swarm.train.group import Group
from echo2swarm.train.grpo import token_logprobs
from echo2swarm.train.trainer import GRPOTrainer

FIRST_CHAR_ID = 4  # ids 0..3 are <pad> <bos> <eos> <unk>


def batch_of(trainer: GRPOTrainer, args: argparse.Namespace, seed: int) -> list[Group]:
    """Random tokens whose behaviour logprobs are the trainer's policy's own (exact checks pass)."""
    rng = random.Random(seed)
    groups = []
    for g in range(args.groups):
        completions = [[rng.randrange(FIRST_CHAR_ID, trainer.vocab_size) for _ in range(args.completion_len)]
                       for _ in range(args.group_size)]
        groups.append(Group(
            prompt_id=f"bench-{seed}-{g}", version=1,
            prompt_ids=[rng.randrange(FIRST_CHAR_ID, trainer.vocab_size) for _ in range(args.prompt_len)],
            completions=completions, behaviour_logprobs=[[0.0] * len(c) for c in completions],
            rewards=[float(rng.random() < 0.5) for _ in completions], finish_reasons=["length"] * args.group_size,
        ))
    batch = trainer.build_batch(groups)
    with torch.no_grad():
        logprobs = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    row = 0
    for group in groups:
        for j, completion in enumerate(group.completions):
            group.behaviour_logprobs[j] = logprobs[row, logprobs.shape[1] - len(completion):].tolist()
            row += 1
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=16, help="groups (prompts) per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per group")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--completion-len", type=int, default=4)
    parser.add_argument("--ppo-epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="measured steps of each")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.prompt_len + args.completion_len > MAX_POSITIONS:
        parser.error(f"prompt + completion is {args.prompt_len + args.completion_len} tokens; the model has "
                     f"{MAX_POSITIONS} positions")
    if min(args.groups, args.group_size, args.completion_len, args.prompt_len, args.steps, args.ppo_epochs) < 1:
        parser.error("--groups, --group-size, --prompt-len, --completion-len, --ppo-epochs and --steps must be >= 1")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    rows = args.groups * args.group_size
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", seed=0, hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=args.heads)
        base = TrainConfig(device="cpu", ppo_epochs=args.ppo_epochs, minibatches=1, threads=args.threads)
        verify = VerifyConfig(typicality_z=None)
        trainers = {
            "reused": GRPOTrainer(model_dir, base, verify=verify),
            "own forward": GRPOTrainer(model_dir, base.model_copy(update={"micro_batch_sequences": rows}),
                                       verify=verify),
        }
        params = sum(p.numel() for p in trainers["reused"].model.parameters())
        forwards = {name: 0 for name in trainers}
        for name, trainer in trainers.items():
            trainer.model.register_forward_hook(lambda *_, name=name: forwards.__setitem__(name, forwards[name] + 1))
        times: dict[str, list[float]] = {name: [] for name in trainers}
        per_step: dict[str, int] = {}
        for step in range(args.steps + 1):  # step 0 warms up (AdamW state created)
            for name, trainer in trainers.items():
                groups = batch_of(trainer, args, seed=step)
                before = forwards[name]
                started = time.perf_counter()
                stats = trainer.step(groups, current_version=1)
                elapsed = time.perf_counter() - started
                if stats["groups_trained"] != args.groups:
                    raise SystemExit(f"{name}: {stats['groups_trained']} of {args.groups} groups trained "
                                     f"({stats['verify_refused']})")
                if step:
                    times[name].append(elapsed)
                    per_step[name] = forwards[name] - before
    runs: dict[str, Any] = {name: {"step_s": statistics.median(times[name]), "forwards_per_step": per_step[name]}
                            for name in trainers}
    ratio = runs["reused"]["step_s"] / runs["own forward"]["step_s"]
    report = {"model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "params": params},
              "batch": {"groups": args.groups, "group_size": args.group_size, "prompt_len": args.prompt_len,
                        "completion_len": args.completion_len, "ppo_epochs": args.ppo_epochs},
              "threads": args.threads, "torch": torch.__version__, "runs": runs, "ratio": ratio}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"Qwen3 (tiny vocabulary): hidden {args.hidden}, {args.layers} layers, {params / 1e6:.2f}M params; "
          f"{args.groups}x{args.group_size} sequences of {args.prompt_len}+{args.completion_len} tokens, "
          f"ppo_epochs {args.ppo_epochs}, minibatches 1; {args.threads} thread(s), torch {torch.__version__}")
    print(f"{'first update':<14} {'forwards/step':>13} {'step (median)':>14}")
    for name, run in runs.items():
        print(f"{name:<14} {run['forwards_per_step']:>13} {run['step_s'] * 1000:>11.1f} ms")
    print(f"reused / own forward: {ratio:.3f}x the step time")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Sparse delta versions on real GRPO steps: bytes per version against dense bf16, and catch-up sizes.

    python scripts/bench_delta.py [--lr 1e-6 --lr 1e-5] [--updates 1x1 --updates 2x1] [--versions 10]
                                  [--hidden 1024 --layers 8 --heads 16] [--json]

Builds a Qwen3-style model of the size asked for (echo2swarm.models.tiny: character tokenizer,
Qwen3's own initialisation, std 0.02; 69M parameters at the defaults) in a temporary directory,
gives it a short supervised warm-up on the arith task (--max-operand, so that sampled answers are
sometimes right and GRPO groups have mixed rewards), then for each --updates and each --lr, from
that same start:

    version 0 = the warm-up weights cast to bf16 (trainer.weights_state(torch.bfloat16))
    for v = 1 .. --versions:
        TransformersEngine (running version v-1's bf16 values) samples --prompts arith prompts x
        --group-size completions with behaviour logprobs; the task scores them;
        GRPOTrainer.step (fp32 master weights, AdamW at that lr, ppo_epochs x minibatches updates,
        verification off) trains on them; version v = weights_state(bf16, holding version v-1's
        values within --hold-ulps: the learner's publish rule, publish.hold_ulps)
        delta v-1 -> v = encode_delta; apply_delta must rebuild version v bit for bit (asserted)
        other rules (--rules, e.g. round-to-nearest, hold 0.5): the same masters published by
        each rule into its own chain, deltas between those, and how far each published policy is
        from the masters on this step's completions

--updates EPOCHSxMINIBATCHES sets the AdamW updates per version: 1x1 is one update per version (what
the published measurements of RL post-training count: one optimizer step between versions); 2x1 is
the trainer's default (train.ppo_epochs = 2, train.minibatches = 1: two updates per version).

Per version it prints the mean reward and the groups with mixed rewards (the ones GRPO learns from),
the fraction of bf16 values whose bits changed, the dense bytes (safetensors of the bf16 state, what
a dense version ships), the delta bytes, dense/delta, the delta's bytes per changed value, `floor`
(dense over the entropy of the changes given the base's key, H(changed | key) + H(z | key): what any
coder that models each item by its base's exponent alone needs at least), encode and decode seconds and
the step's seconds, `move` (mean |log pi_master(v) - log pi_master(v-1)| a completion token of
this step's completions: how far one version moves the policy) and for each rule h of --rules:
dense/delta of its own chain (`xH`) and `misH`, mean |log pi_published(v) - log pi_master(v)| on
the same tokens: what publishing in bf16 by that rule costs the rollouts in policy mismatch (in
units of `move`, misH / move is a staleness in versions); then means over all versions and over the later half
(AdamW's second moments settle over the first steps, and the changed fraction with them). Then
catch-up at the last version V: for a gap g in --gaps, the composite delta V-g -> V against the
chain of g single deltas, each as dense/bytes (verified bit-exact too). With --compare (default on,
runs of the first --updates only), the encoding alternatives on the last delta: the entropy floors
(without context and given the base's key, split into positions and values), e2s-delta/1's layout
(and its positions and values apart), e2s-delta/2 with every class's positions coded one way, and the
codec at several zstd levels with encode/decode seconds. --json prints one JSON object at the end as well.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402
from safetensors.torch import save as save_safetensors  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from echo2swarm.config.models import PublishConfig  # noqa: E402
from echo2swarm.config.rl import TrainConfig, VerifyConfig  # noqa: E402
from echo2swarm.train.batches import Batch  # noqa: E402
from echo2swarm.train.group import Group  # noqa: E402
from echo2swarm.train.grpo import completion_logits  # noqa: E402
from echo2swarm.train.rounding import publish_dtype  # noqa: E402
from echo2swarm.train.trainer import GRPOTrainer  # noqa: E402
from echo2swarm.models.tiny import build_tiny_model  # noqa: E402
from echo2swarm.models.warmup import supervised_warmup  # noqa: E402
from echo2swarm.policy import delta as codec  # noqa: E402
from echo2swarm.policy import orders as codec_orders  # noqa: E402
from echo2swarm.policy.delta import (  # noqa: E402
    ZSTD_LEVEL,
    apply_delta,
    encode_delta,
    encode_varints,
    tensor_bits,
)
from echo2swarm.rollout.engines.base import SamplingParams  # noqa: E402
from echo2swarm.rollout.engines.hf import TransformersEngine  # noqa: E402
from echo2swarm.tasks.arith import ArithTask  # noqa: E402

State = dict[str, torch.Tensor]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_model_dir(root: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    model, tokenizer = build_tiny_model(seed=args.seed, hidden_size=args.hidden, num_layers=args.layers,
                                        num_heads=args.heads)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads: {params / 1e6:.1f}M parameters "
        f"(init std {model.config.initializer_range})")
    started = time.perf_counter()
    if args.warmup_steps:
        task = ArithTask(seed=args.seed, max_operand=args.max_operand)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            supervised_warmup(model, tokenizer, task, steps=args.warmup_steps, batch_size=args.warmup_batch,
                              lr=args.warmup_lr, seed=args.seed,
                              progress=lambda s, loss: log(f"  warm-up step {s}: loss {loss:.3f}")
                              if s % 10 == 0 else None)
    model.eval()
    path = root / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, {"params": params, "warmup_s": time.perf_counter() - started}


def load_into_engine(engine: TransformersEngine, state: State) -> None:
    """The engine runs the published bf16 values (in its own fp32 parameters on the CPU)."""
    missing, unexpected = engine.model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"engine state mismatch: missing {missing}, unexpected {unexpected}")


def rollout_groups(engine: TransformersEngine, trainer: GRPOTrainer, task: ArithTask, version: int,
                   args: argparse.Namespace) -> list[Group]:
    first = (version - 1) * args.prompts
    prompts = [task.prompt(first + i) for i in range(args.prompts)]
    sampled = engine.generate([p.text for p in prompts],
                              SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens, seed=version))
    groups = []
    for prompt, completions in zip(prompts, sampled):
        texts = [trainer.decode(c.token_ids) for c in completions]
        groups.append(Group(
            prompt_id=prompt.prompt_id, version=version - 1, prompt_ids=trainer.encode_prompt(prompt.text),
            completions=[list(c.token_ids) for c in completions],
            behaviour_logprobs=[list(c.logprobs) for c in completions],
            rewards=[task.reward(prompt.prompt_id, t, c.finish_reason == "stop") for t, c in zip(texts, completions)],
            finish_reasons=[c.finish_reason for c in completions],
        ))
    return groups


def score(model: torch.nn.Module, state: State, batch: Batch) -> torch.Tensor:
    """Token logprobs of the batch's completions under `state` (loaded into `model` in fp32)."""
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"scorer state mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        return completion_logits(model, batch.input_ids, batch.attention_mask, batch.completion_mask).token_logprobs()


def mismatch(a: torch.Tensor, b: torch.Tensor, batch: Batch) -> float:
    """Mean |a - b| over the completion tokens (the positions that are scored)."""
    keep = batch.completion_mask.bool()
    keep[:, 0] = False
    return float((a - b).abs()[keep].mean())


def changed_count(base: State, new: State) -> int:
    return sum(int(np.count_nonzero(tensor_bits(base[k]) != tensor_bits(new[k]))) for k in base)


def timed_delta(base: State, new: State, level: int = ZSTD_LEVEL) -> tuple[bytes, float, float]:
    """The delta, its encode and decode seconds; asserts the rebuild is bit-identical to `new`."""
    started = time.perf_counter()
    blob = encode_delta(base, new, level=level)
    encoded = time.perf_counter()
    rebuilt = apply_delta(base, blob)
    decoded = time.perf_counter()
    for name, t in new.items():
        assert np.array_equal(tensor_bits(rebuilt[name]), tensor_bits(t)), f"{name} not rebuilt bit for bit"
    return blob, encoded - started, decoded - encoded


# --------------------------------------------------------------------------- encoding alternatives

def _zstd(data: bytes, level: int = ZSTD_LEVEL) -> int:
    return len(zstandard.ZstdCompressor(level=level).compress(data))


def _entropy_bits(values: np.ndarray) -> float:
    """Order-0 empirical entropy of `values`, in bits in total."""
    if not values.size:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(counts * np.log2(p)).sum())


def _counts_bits(counts: np.ndarray) -> float:
    """sum over the rows (contexts) of the order-0 entropy of each row's counts, in bits."""
    counts = counts.astype(np.float64)
    totals = counts.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, counts * np.log2(np.where(counts > 0, counts / totals, 1.0)), 0.0)
    return float(-terms.sum())


def floors(base: State, new: State) -> dict[str, float]:
    """Entropy floors of the changes, in bits: positions (did an item change) and values (z = zigzag(d) - 1
    of each change), without context and given the base's key (the 8 bits below the sign: the follower
    knows it, so any function of it is free context). Item sizes above 2 count their values unconditioned."""
    pos = np.zeros((256, 2), np.int64)
    values: dict[int, list[np.ndarray]] = {}
    for name in base:
        old, now = tensor_bits(base[name]), tensor_bits(new[name])
        size = old.dtype.itemsize
        key = np.zeros(old.size, np.int64) if size == 1 else (old >> old.dtype.type(8 * size - 9)).astype(np.uint8)
        changed = old != now
        pos += np.bincount(key.astype(np.int64) * 2 + changed, minlength=512).reshape(256, 2)
        d = (now[changed] - old[changed]).view(f"i{size}").astype(np.int64)
        z = np.where(d >= 0, 2 * d, -2 * d - 1) - 1
        values.setdefault(size, []).append(key[changed].astype(np.int64) * (1 << 16) + z if size <= 2 else z)
    out = {"positions": _counts_bits(pos.sum(axis=0)), "positions_given_key": _counts_bits(pos),
           "values": 0.0, "values_given_key": 0.0}
    for size, parts in values.items():
        joint = np.concatenate(parts)
        if size <= 2:
            by_key = np.bincount(joint, minlength=256 << 16).reshape(256, 1 << 16)
            out["values"] += _counts_bits(by_key.sum(axis=0))
            out["values_given_key"] += _counts_bits(by_key)
        else:
            out["values"] += _entropy_bits(joint)
            out["values_given_key"] += _entropy_bits(joint)
    return out


def _layout_v1(base: State, new: State) -> tuple[bytes, list[np.ndarray], list[np.ndarray]]:
    """e2s-delta/1's streams (sized, not decoded): per tensor, runs of 2^20 items visited by the base's key
    then index; the gaps between changed ranks; zigzag value words (n, itemsize) bytes."""
    table, gaps, words = [b"E2SD\x01\x00" + len(new).to_bytes(4, "little")], [], []
    for name in sorted(new):
        old_bits, new_bits = tensor_bits(base[name]), tensor_bits(new[name])
        size = old_bits.dtype.itemsize
        ranks, index = [], []
        for start in range(0, old_bits.size, codec_orders.RUN_ITEMS):
            old, now = old_bits[start:start + codec_orders.RUN_ITEMS], new_bits[start:start + codec_orders.RUN_ITEMS]
            keys = codec_orders.run_keys(old)
            order = np.arange(old.size) if keys is None else np.argsort(keys, kind="stable")
            rank = np.flatnonzero((old != now)[order])
            ranks.append(rank + start)
            index.append(order[rank] + start)
        rank, idx = (np.concatenate(ranks), np.concatenate(index)) if ranks else (np.zeros(0, int), np.zeros(0, int))
        encoded = name.encode()
        table.append(len(encoded).to_bytes(2, "little") + encoded + bytes([size]) + old_bits.size.to_bytes(8, "little")
                     + rank.size.to_bytes(8, "little"))
        gaps.append(np.diff(rank, prepend=-1).astype(np.uint64))
        o, n = old_bits[idx], new_bits[idx]
        signed = (n - o).view(f"i{size}")
        zig = ((signed << 1) ^ (signed >> (8 * size - 1))).view(f"u{size}")
        words.append(zig.astype(f"<u{size}").view(np.uint8).reshape(-1, size))
    return b"".join(table), gaps, words


def compare_encodings(base: State, new: State) -> list[dict[str, Any]]:
    """Sizes of the same changes under other layouts, the floors, and the codec at several zstd levels."""
    n_changed = changed_count(base, new)
    rows: list[dict[str, Any]] = []

    def add(label: str, size: int, seconds: float | None = None, decode_s: float | None = None) -> None:
        rows.append({"encoding": label, "bytes": size, "bytes_per_change": size / max(n_changed, 1),
                     "encode_s": seconds, "decode_s": decode_s})

    floor = floors(base, new)
    add("floor, no context: H(changed) + H(z)", math.ceil((floor["positions"] + floor["values"]) / 8))
    add("  of which positions H(changed)", math.ceil(floor["positions"] / 8))
    add("floor given the base's key: H(changed | key) + H(z | key)",
        math.ceil((floor["positions_given_key"] + floor["values_given_key"]) / 8))
    add("  of which positions H(changed | key)", math.ceil(floor["positions_given_key"] / 8))
    add("  of which values H(z | key)", math.ceil(floor["values_given_key"] / 8))
    table, gaps, words = _layout_v1(base, new)
    varints = encode_varints(np.concatenate(gaps)).tobytes()
    planes = b"".join(w[:, j].tobytes() for j in range(8) for w in words if w.shape[1] > j)
    add("e2s-delta/1: exponent order in runs, gaps + zigzag byte planes, zstd-1", _zstd(table + varints + planes, 1))
    add("  of which positions (gaps, zstd-1 alone)", _zstd(varints, 1))
    add("  of which values (zigzag planes, zstd-1 alone)", _zstd(planes, 1))
    band = codec.BITMAP_BAND
    try:
        for label, override in (("every class's positions as gaps of the changed", (1.0, 1.0)),
                                ("every class's positions as a bitmap (all or none: gaps)", (0.0, 1.0))):
            codec.BITMAP_BAND = override
            add(f"e2s-delta/2 with {label}, zstd-1", len(encode_delta(base, new)))
    finally:
        codec.BITMAP_BAND = band
    for level in (1, 3, 9, 19):
        blob, enc, dec = timed_delta(base, new, level=level)
        add(f"{'CHOSEN' if level == ZSTD_LEVEL else 'chosen layout'}: e2s-delta/2 (classes by key: bitmap "
            f"{band[0]:g} < p < {band[1]:g}, else gaps; values at the class's width), zstd-{level}",
            len(blob), enc, dec)
    return rows


# --------------------------------------------------------------------------- one run per lr

def run_lr(model_dir: Path, lr: float, updates: tuple[int, int], args: argparse.Namespace,
           with_encodings: bool) -> dict[str, Any]:
    epochs, minibatches = updates
    config = TrainConfig(lr=lr, group_size=args.group_size, prompts_per_step=args.prompts,
                         max_new_tokens=args.max_new_tokens, threads=args.threads, seed=args.seed,
                         ppo_epochs=epochs, minibatches=minibatches)
    trainer = GRPOTrainer(model_dir, config, verify=VerifyConfig(enabled=False))
    engine = TransformersEngine(model_dir, threads=args.threads)
    task = ArithTask(seed=args.seed, max_operand=args.max_operand)
    dtype = publish_dtype("bfloat16")
    states = [trainer.weights_state(dtype)]
    chains = {h: states[0] for h in args.rules}  # each rule's previous published version
    scorer = copy.deepcopy(trainer.model).eval()  # scores completions under any state
    masters = {k: v.clone() for k, v in trainer.weights_state().items()}
    dense = len(save_safetensors(states[0], metadata={"format": "pt"}))
    numel = sum(t.numel() for t in states[0].values())
    singles: list[int] = []
    rows = []
    label = f"lr {lr:g}, {epochs}x{minibatches} updates"
    log(f"{label}: {numel / 1e6:.1f}M values, dense bf16 version {dense / 1e6:.2f} MB")
    header = (f"{'v':>3} {'reward':>6} {'mixed':>5} {'changed':>8} {'dense MB':>9} {'delta KB':>9} "
              f"{'dense/delta':>11} {'B/changed':>9} {'floor':>7} {'enc s':>6} {'dec s':>6} {'step s':>6} "
              f"{'move':>6}" + "".join(f" {'x' + f'{h:g}':>6} {'mis' + f'{h:g}':>7}" for h in args.rules))
    print(f"\n## lr {lr:g}, {epochs} epochs x {minibatches} minibatches = {epochs * minibatches} AdamW updates "
          f"per version, published with hold_ulps {args.hold_ulps:g}\n{header}", flush=True)
    for version in range(1, args.versions + 1):
        load_into_engine(engine, states[-1])
        groups = rollout_groups(engine, trainer, task, version, args)
        stats = trainer.step(groups, current_version=version - 1)
        states.append(trainer.weights_state(dtype, states[-1], args.hold_ulps))
        dense = len(save_safetensors(states[-1], metadata={"format": "pt"}))
        blob, enc, dec = timed_delta(states[-2], states[-1])
        batch = trainer.build_batch(groups)
        previous_masters, masters = masters, {k: v.clone() for k, v in trainer.weights_state().items()}
        master_lp = score(scorer, masters, batch)
        move = mismatch(score(scorer, previous_masters, batch), master_lp, batch)
        rules = {}
        for h in args.rules:
            published = trainer.weights_state(dtype, chains[h], h)
            rules[h] = {"ratio": dense / len(encode_delta(chains[h], published)),
                        "mismatch": mismatch(score(scorer, published, batch), master_lp, batch)}
            chains[h] = published
        changed = changed_count(states[-2], states[-1])
        floor = floors(states[-2], states[-1])
        floor_bytes = (floor["positions_given_key"] + floor["values_given_key"]) / 8
        singles.append(len(blob))
        mixed = sum(len(set(g.rewards)) > 1 for g in groups)
        row = {"version": version, "reward_mean": stats.get("reward_mean", 0.0), "mixed_groups": mixed,
               "changed_frac": changed / numel, "dense_bytes": dense, "delta_bytes": len(blob),
               "ratio": dense / len(blob), "bytes_per_changed": len(blob) / max(changed, 1),
               "floor_bytes": floor_bytes, "floor_ratio": dense / max(floor_bytes, 1.0),
               "encode_s": enc, "decode_s": dec, "step_s": stats.get("t_train_s", 0.0),
               "updates": stats.get("updates", 0), "move": move, "rules": rules}
        rows.append(row)
        print(f"{version:>3} {row['reward_mean']:>6.2f} {mixed:>2}/{len(groups):<2} {row['changed_frac']:>8.2%} "
              f"{dense / 1e6:>9.2f} {len(blob) / 1e3:>9.1f} {row['ratio']:>10.1f}x {row['bytes_per_changed']:>9.3f} "
              f"{row['floor_ratio']:>6.1f}x {enc:>6.2f} {dec:>6.2f} {row['step_s']:>6.1f} {move:>6.4f}"
              + "".join(f" {r['ratio']:>5.1f}x {r['mismatch']:>7.4f}" for r in rules.values()), flush=True)
        if len(states) > max(args.gaps) + 1:
            states.pop(0)
    late = rows[len(rows) // 2:]
    for label_rows, what in ((rows, f"all {len(rows)} versions"), (late, f"v{late[0]['version']}..v{late[-1]['version']}")):
        print(f"mean over {what}: changed {statistics.mean(r['changed_frac'] for r in label_rows):.2%}, "
              f"dense/delta {statistics.mean(r['ratio'] for r in label_rows):.1f}x "
              f"(min {min(r['ratio'] for r in label_rows):.1f}x; "
              f"floor {statistics.mean(r['floor_ratio'] for r in label_rows):.1f}x), "
              f"{statistics.mean(r['bytes_per_changed'] for r in label_rows):.3f} B per changed value, "
              f"encode {statistics.mean(r['encode_s'] for r in label_rows):.2f} s, "
              f"decode {statistics.mean(r['decode_s'] for r in label_rows):.2f} s", flush=True)
        move = statistics.mean(r["move"] for r in label_rows)
        for h in args.rules:
            ratios = [r["rules"][h]["ratio"] for r in label_rows]
            mis = statistics.mean(r["rules"][h]["mismatch"] for r in label_rows)
            print(f"  rule hold {h:g}{' (round-to-nearest)' if h == 0.5 else ''}: dense/delta "
                  f"{statistics.mean(ratios):.1f}x (min {min(ratios):.1f}x), mismatch {mis:.4f} "
                  f"= {mis / max(move, 1e-12):.2f} versions' move ({move:.4f})", flush=True)

    catch_up = []
    last = states[-1]
    print(f"\ncatch-up to v{args.versions} ({label}): composite delta v-g -> v vs the chain of g single deltas",
          flush=True)
    print(f"{'gap':>4} {'changed':>8} {'composite KB':>12} {'dense/comp':>10} {'chain KB':>9} {'dense/chain':>11} "
          f"{'comp/chain':>10}", flush=True)
    for gap in args.gaps:
        if gap > args.versions:
            continue
        base = states[-1 - gap]
        blob, _, _ = timed_delta(base, last)
        chain = sum(singles[-gap:])
        changed = changed_count(base, last)
        item = {"gap": gap, "changed_frac": changed / numel, "composite_bytes": len(blob),
                "composite_ratio": dense / len(blob), "chain_bytes": chain, "chain_ratio": dense / chain}
        catch_up.append(item)
        print(f"{gap:>4} {changed / numel:>8.2%} {len(blob) / 1e3:>12.1f} {dense / len(blob):>9.1f}x "
              f"{chain / 1e3:>9.1f} {dense / chain:>10.1f}x {len(blob) / chain:>10.2f}", flush=True)

    compare = []
    if with_encodings:
        compare = compare_encodings(states[-2], states[-1])
        print(f"\nencodings of the v{args.versions - 1} -> v{args.versions} delta ({label}; "
              f"dense {dense / 1e6:.2f} MB):", flush=True)
        print(f"{'bytes':>10} {'dense/x':>8} {'B/changed':>9} {'enc s':>6} {'dec s':>6}  encoding", flush=True)
        for r in compare:
            times = "".join(f"{r[k]:>6.2f} " if r[k] is not None else f"{'':>6} " for k in ("encode_s", "decode_s"))
            print(f"{r['bytes']:>10} {dense / r['bytes']:>7.1f}x {r['bytes_per_change']:>9.3f} {times} {r['encoding']}",
                  flush=True)
    engine.close()
    return {"lr": lr, "ppo_epochs": epochs, "minibatches": minibatches, "values": numel, "versions": rows, "catch_up": catch_up, "encodings": compare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lr", type=float, action="append", help="AdamW lr; repeatable (default: 1e-6 and 1e-5)")
    parser.add_argument("--versions", type=int, default=10, help="GRPO steps (versions) per lr")
    parser.add_argument("--updates", action="append",
                        help="EPOCHSxMINIBATCHES: AdamW updates per version (train.ppo_epochs x train.minibatches); "
                             "repeatable (default: 1x1, one update per version as in the published measurements, "
                             "and 2x1, the trainer's default)")
    parser.add_argument("--gaps", default="1,2,4,8", help="catch-up gaps measured at the last version")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (intermediate is 2x)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16, help="attention heads (2 KV heads)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (groups) per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--max-operand", type=int, default=4,
                        help="arith operands 0..N (small, so the briefly warmed-up model is sometimes right)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="supervised warm-up steps before RL (0: none)")
    parser.add_argument("--warmup-batch", type=int, default=16)
    parser.add_argument("--warmup-lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hold-ulps", type=float, default=PublishConfig().hold_ulps,
                        help="the publish rule of the versions the engine runs (publish.hold_ulps; default: the "
                             "learner's): 0.5 is round-to-nearest")
    parser.add_argument("--rules", default="0.5,0.75,1.0",
                        help="publish rules (hold_ulps values) to compare on the same masters: each one's delta "
                             "bytes and policy mismatch")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip the table of encoding alternatives")
    parser.add_argument("--json", action="store_true", help="also print one JSON object at the end")
    args = parser.parse_args()
    args.lr = args.lr or [1e-6, 1e-5]
    try:
        args.updates = [tuple(int(x) for x in u.lower().split("x")) for u in (args.updates or ["1x1", "2x1"])]
    except ValueError:
        parser.error("--updates takes EPOCHSxMINIBATCHES, e.g. 1x1 or 2x2")
    if any(len(u) != 2 or min(u) < 1 for u in args.updates):
        parser.error("--updates takes EPOCHSxMINIBATCHES with both >= 1, e.g. 1x1 or 2x2")
    args.gaps = sorted({int(g) for g in args.gaps.split(",")})
    try:
        args.rules = sorted({float(h) for h in args.rules.split(",") if h} | {args.hold_ulps})
    except ValueError:
        parser.error("--rules takes hold_ulps values, e.g. 0.5,0.75,1.0")
    if any(not 0.5 <= h <= 2.0 for h in args.rules):
        parser.error("--rules and --hold-ulps: values in 0.5 .. 2.0 (publish.hold_ulps)")
    if args.versions < 1 or min(args.gaps) < 1:
        parser.error("--versions and every --gaps entry must be >= 1")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        model_dir, model_info = build_model_dir(Path(tmp), args)
        runs = [run_lr(model_dir, lr, updates, args, with_encodings=args.compare and updates == args.updates[0])
                for updates in args.updates for lr in args.lr]
    report = {"args": {k: v for k, v in vars(args).items()}, **model_info, "runs": runs,
              "wall_s": time.perf_counter() - started}
    print("\nsummary: dense bf16 / delta per version (mean of all versions, of the later half, min) and catch-up "
          "dense/composite by gap")
    for run in runs:
        ratios = [r["ratio"] for r in run["versions"]]
        gaps = ", ".join(f"g{c['gap']} {c['composite_ratio']:.1f}x" for c in run["catch_up"])
        rules = ", ".join(f"hold {h:g} {statistics.mean(r['rules'][h]['ratio'] for r in run['versions']):.1f}x"
                          for h in args.rules)
        print(f"  lr {run['lr']:g}, {run['ppo_epochs']}x{run['minibatches']} updates (hold {args.hold_ulps:g}): "
              f"{statistics.mean(ratios):.1f}x, later half {statistics.mean(ratios[len(ratios) // 2:]):.1f}x "
              f"(min {min(ratios):.1f}x); catch-up {gaps}; the same masters by rule: {rules}")
    print(f"wall {report['wall_s']:.0f} s", flush=True)
    if args.json:
        print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()

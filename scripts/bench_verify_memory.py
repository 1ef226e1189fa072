#!/usr/bin/env python
"""The learner's peak memory with verification of older versions on and off, for a policy of an
8B's shape (issue 33 item 4): older versions streamed from their files (train/streamed.py) against
the whole fp32 spare copy the verifier loaded before, in one run.

    python scripts/bench_verify_memory.py [--layers 2] [--hidden 4096 --intermediate 12288 --heads 32 --kv-heads 8]
                                          [--vocab 0] [--steps 2] [--device cpu|cuda] [--json]

A Qwen3 of Qwen3-8B's layer shape (hidden 4096, MLP 12288, 32 heads, 8 key/value heads of 128), random
init, `--layers` deep (2 by default: an 8B's 36 do not fit this machine's memory with their AdamW
state), `--vocab` 0 the character vocabulary (the real 151,936 makes the embedding the largest module;
pass it where memory allows). Three fresh processes, each the plain single-device GRPOTrainer:

- off: verification disabled;
- streamed: verification on, every group one version old and checked exactly (sample_fraction 1),
  version 1 published in bf16 to a directory as the learner does: the exact check streams it;
- whole: the same, but the verifier loads version 1 into a whole fp32 copy of the policy (what it did
  before streaming), the baseline.

Each warms up (AdamW state made), then takes `--steps` measured steps; figures: the peak anonymous
resident set (RssAnon, sampled every 5 ms) over the measured steps less the process's before the model
was built (with `--device cuda`: the GPU's peak allocation), and the median step time. Ratios against "off" are printed in the same run. Tolerances are
open wide, so every group trains in every variant: the steps differ only by the check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from bench_learner import GIB, AnonPeak, reset_peak_rss, rss_bytes, state_bytes, synthetic_groups  # noqa: E402
from echo2swarm.config.rl import TrainConfig, VerifyConfig  # noqa: E402
from echo2swarm.models.tiny import MAX_POSITIONS, build_char_tokenizer  # noqa: E402

VARIANTS = ("off", "streamed", "whole")


def variant_main(variant: str, model_dir: str, args: argparse.Namespace, results: Any) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from echo2swarm.models.files import write_model_dir
    from echo2swarm.train.trainer import GRPOTrainer
    from echo2swarm.train.verify import Verifier

    config = TrainConfig(device=args.device, lr=1e-5, group_size=args.group_size, max_new_tokens=args.completion_len,
                         ppo_epochs=1, minibatches=1, threads=args.threads)
    wide = VerifyConfig(enabled=variant != "off", seed=0, sample_fraction=1.0, exact_tolerance=1e9,
                        exact_mean_tolerance=1e9, typicality_z=None, require_seeded=False, peer_choice_threshold=None,
                        peer_z_threshold=None)
    groups = synthetic_groups(args.vocab, args)  # declared as version 1
    root = Path(model_dir).parent
    baseline_anon = rss_bytes("RssAnon")
    trainer = GRPOTrainer(Path(model_dir), config, verify=wide,
                          weights_of=lambda v: root / f"v{v}" if v == 1 else None)
    if not (root / "v1").exists():  # the first variant publishes it, as the learner would
        write_model_dir(Path(model_dir), root / "v1", trainer.weights_bytes(torch.bfloat16))
    if variant == "whole":
        trainer.verifier = Verifier(wide, temperature=config.temperature, top_p=config.top_p,
                                    weights_of=lambda v: root / f"v{v}" if v == 1 else None,
                                    make_spare=trainer._spare_model)

    def run_step() -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        stats = trainer.step(groups, current_version=2)  # every group one version old
        return time.perf_counter() - started, stats

    for _ in range(args.warmup):
        run_step()
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(trainer.device)
        torch.cuda.reset_peak_memory_stats(trainer.device)
    reset_peak_rss()
    with AnonPeak() as anon:
        measured = [run_step() for _ in range(args.steps)]
    last = measured[-1][1]
    # CUDA: the device's peak allocation; the CPU: the peak anonymous resident set over the process's
    # before the model was built.
    peak = torch.cuda.max_memory_allocated(trainer.device) if cuda else anon.peak - baseline_anon
    results.put({"variant": variant, "step_s": statistics.median(t for t, _ in measured),
                 "trainer_gib": peak / GIB, "state_gib": state_bytes(trainer) / GIB,
                 "exact": last.get("verify_exact", 0), "refused": len(last.get("refused_groups", [])),
                 "device": torch.cuda.get_device_name(trainer.device) if cuda else "cpu"})


def measure(variant: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=variant_main, args=(variant, str(model_dir), args, results))
    proc.start()
    deadline = time.monotonic() + args.timeout_s
    while True:
        if time.monotonic() > deadline or proc.exitcode not in (None, 0):
            proc.kill()
            raise SystemExit(f"{variant}: the process failed (exit code {proc.exitcode}) or ran past --timeout-s")
        try:
            row = results.get(timeout=1.0)
            break
        except Exception:
            continue
    proc.join(timeout=60)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the character vocabulary)")
    parser.add_argument("--groups", type=int, default=4, help="groups per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: peak GPU memory allocated instead of RssAnon")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.prompt_len + args.completion_len > MAX_POSITIONS:
        parser.error(f"--prompt-len + --completion-len must be at most {MAX_POSITIONS}")
    tokenizer = build_char_tokenizer()
    args.vocab = args.vocab or len(tokenizer)
    if args.vocab < len(tokenizer):
        parser.error(f"--vocab must be 0 or at least the character vocabulary's {len(tokenizer)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-verify-memory-") as tmp:
        model_dir = Path(tmp) / "model"
        config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                             max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, dtype=torch.float32,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(config)
        params = model.num_parameters()
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del model
        for variant in VARIANTS:
            rows.append(measure(variant, model_dir, args))
            print(f"  {variant}: done", file=sys.stderr, flush=True)
    off = rows[0]
    for r in rows:
        r["memory_ratio"] = r["trainer_gib"] / off["trainer_gib"]
        r["time_ratio"] = r["step_s"] / off["step_s"]
    report = {"model": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                        "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "params": params},
              "batch": {"groups": args.groups, "group_size": args.group_size, "prompt_len": args.prompt_len,
                        "completion_len": args.completion_len}, "torch": torch.__version__, "runs": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"Qwen3, layer shape of Qwen3-8B (hidden {args.hidden}, MLP {args.intermediate}, {args.heads}/{args.kv_heads} "
          f"heads), {args.layers} layers, vocabulary {args.vocab}: {params / 1e9:.3f}B params, fp32 masters, AdamW; "
          f"{args.groups}x{args.group_size} sequences of {args.prompt_len}+{args.completion_len} tokens a step, all one "
          f"version old; median of {args.steps} steps after {args.warmup}; {rows[0]['device']}")
    print(f"{'verification':<14}{'peak GiB':>10}{'x off':>8}{'step s':>9}{'x off':>8}{'state GiB':>11}"
          f"{'checked exactly':>17}{'refused':>9}")
    for r in rows:
        print(f"{r['variant']:<14}{r['trainer_gib']:>10.3f}{r['memory_ratio']:>8.3f}{r['step_s']:>9.2f}"
              f"{r['time_ratio']:>8.2f}{r['state_gib']:>11.3f}{r['exact']:>17}{r['refused']:>9}")


if __name__ == "__main__":
    main()

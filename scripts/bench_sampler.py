#!/usr/bin/env python
"""Seeded sampling (issue 33): how far honest engines' choices sit from what the learner re-derives,
which sets `verify.sample_tolerance` (δ), and how often a peer that samples otherwise is caught.

    python scripts/bench_sampler.py [--model DIR] [--groups 256] [--steps 3] [--delta 0.5]

1. Honest gaps. A trainer (fp32 masters, lr 3e-4) takes `--steps` real GRPO steps on honest seeded
   groups and publishes every version, in bf16 and (a second run) in fp32. The transformers engine
   in fp32 and in bf16 loads the newest published version and samples `--groups` groups of 8 with
   the lease's seeded sampler at T in {1.0, 0.7} and top_p in {1.0, 0.9}. The learner re-derives every
   choice as the verifier does (δ / T on logits / T) from (a) version t as published, read into an
   fp32 model (what decides), and (b) its fp32 masters (its step's own forward): per completion, the
   largest gap between the best perturbed score in the nucleus and the sent token's, tokens flagged
   outside the nucleus, groups refused. Also the quantity δ bounds by definition: the largest spread,
   over the vocabulary (and over its tokens with p >= 1e-4), of engine minus learner logits / T per
   position, with the engine's model run over the whole sequence in its own dtype.
2. Attacks (bf16 published, fp32 engine holding the policy, lease T = 1, top_p = 1), at each of
   `--attack-deltas`: the share of groups the seeded-choice check refuses when the peer samples at
   T 1.2 or 0.8, with top_p 0.9, greedily, with a differently initialised model of the same
   architecture, with its own generator (one draw, or the best of 4 by reward), or re-sends an
   honest group of another lease. Logprobs do not matter to this check, so none are forged here.

--model defaults to a tiny model warmed up on arith to ~30 % accuracy (minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from echo2swarm.config.rl import TrainConfig, VerifyConfig  # noqa: E402
from echo2swarm.models.files import write_model_dir  # noqa: E402
from echo2swarm.models.tiny import write_tiny_model  # noqa: E402
from echo2swarm.rollout.engines.base import SamplingParams  # noqa: E402
from echo2swarm.rollout.engines.hf import TransformersEngine  # noqa: E402
from echo2swarm.tasks.arith import ArithTask  # noqa: E402
from echo2swarm.train.batches import build_batch  # noqa: E402
from echo2swarm.train.group import Group  # noqa: E402
from echo2swarm.train.grpo import completion_logits  # noqa: E402
from echo2swarm.train.scoring import choice_gaps_of  # noqa: E402
from echo2swarm.train.trainer import GRPOTrainer  # noqa: E402
from echo2swarm.train.verify import load_policy_weights  # noqa: E402
from echo2swarm.wire.sampling import SAMPLER, completion_key  # noqa: E402

TASK = ArithTask(seed=0)
SETTINGS = [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def groups_of(trainer: GRPOTrainer, engine: TransformersEngine, indices: range, version: int, seed: int, *,
              temperature: float, top_p: float, sampler: str | None = SAMPLER) -> list[Group]:
    prompts = [TASK.prompt(i) for i in indices]
    ids = tuple(p.prompt_id for p in prompts) if sampler else None
    params = SamplingParams(n=8, max_new_tokens=trainer.config.max_new_tokens, temperature=temperature, top_p=top_p,
                            seed=seed, sampler=sampler, prompt_ids=ids)
    out = engine.generate([p.text for p in prompts], params)
    return [Group(prompt_id=p.prompt_id, version=version, prompt_ids=trainer.encode_prompt(p.text),
                  completions=[c.token_ids for c in cs], behaviour_logprobs=[c.logprobs for c in cs],
                  rewards=[TASK.reward(p.prompt_id, trainer.decode(c.token_ids), c.finish_reason == "stop")
                           for c in cs],
                  finish_reasons=[c.finish_reason for c in cs], sampler=SAMPLER, seed=seed)
            for p, cs in zip(prompts, out)]


def keys_of(groups: list[Group], seed: int | None = None) -> torch.Tensor:
    """Every row's key words, from each group's own seed (or `seed`: the lease the learner knows)."""
    return torch.tensor([completion_key(seed if seed is not None else g.seed, g.prompt_id, j)  # type: ignore[arg-type]
                         for g in groups for j in range(len(g.completions))], dtype=torch.long)


def gaps(model: torch.nn.Module, trainer: GRPOTrainer, groups: list[Group], temperature: float, top_p: float,
         delta: float, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the largest choice gap and whether a token was flagged outside the nucleus."""
    batch = build_batch(groups, pad_id=trainer.pad_id, scale_std=True, device=torch.device("cpu"))
    with torch.no_grad():
        scored = completion_logits(model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                   temperature=temperature)
        return choice_gaps_of(scored, batch.completion_mask, keys_of(groups, seed),
                              torch.arange(batch.input_ids.shape[0]), top_p=top_p, delta=delta)[:2]


def logit_spread(engine_model: torch.nn.Module, model: torch.nn.Module, trainer: GRPOTrainer, groups: list[Group],
                 temperature: float) -> tuple[float, float]:
    """max over positions of (max_v - min_v) of (engine logits - learner logits) / T: over the whole
    vocabulary, and over the tokens the learner gives p >= 1e-4 (the ones that can win a draw)."""
    batch = build_batch(groups, pad_id=trainer.pad_id, scale_std=True, device=torch.device("cpu"))
    with torch.no_grad():
        mine = completion_logits(model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                 temperature=temperature)
        theirs = completion_logits(engine_model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                   temperature=temperature)
    keep = mine.keep[:, mine.first:]
    diff, logits = (theirs.logits - mine.logits)[keep], mine.logits[keep]
    relevant = torch.softmax(logits, dim=-1) >= 1e-4
    spread = diff.amax(dim=-1) - diff.amin(dim=-1)
    near = diff.masked_fill(~relevant, -torch.inf).amax(dim=-1) - diff.masked_fill(~relevant, torch.inf).amin(dim=-1)
    return float(spread.max()), float(near.max())


def group_refused(row_gap: torch.Tensor, row_out: torch.Tensor, delta: float, group_size: int = 8) -> torch.Tensor:
    bad = (row_gap > delta) | row_out
    return bad.view(-1, group_size).any(dim=1)


class Run:
    """A trainer publishing every version in `publish` dtype, its versions on disk, two engines."""

    def __init__(self, model_dir: Path, root: Path, publish: torch.dtype, args: argparse.Namespace):
        self.model_dir, self.root, self.publish_dtype = model_dir, root, publish
        self.trainer = GRPOTrainer(model_dir, TrainConfig(device="cpu", threads=args.threads, prompts_per_step=16),
                                   verify=VerifyConfig(enabled=False))
        self.version = 1
        self.publish()
        self.engines = {name: TransformersEngine(model_dir, threads=args.threads, dtype=dtype)
                        for name, dtype in DTYPES.items()}
        for step in range(args.steps):
            self.follow()
            groups = groups_of(self.trainer, self.engines["fp32"], range(5000 + 16 * step, 5016 + 16 * step),
                               self.version, seed=step, temperature=1.0, top_p=1.0)
            for g in groups:  # a learning signal whatever the model answers
                g.rewards = [float(i % 2 == 0) for i in range(8)]
            self.trainer.step(groups, current_version=self.version)
            self.version += 1
            self.publish()
        self.follow()
        self.published = self.trainer._spare_model()
        load_policy_weights(self.published, load_file(self.dir(self.version) / "model.safetensors"))

    def dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def publish(self) -> None:
        write_model_dir(self.model_dir, self.dir(self.version), self.trainer.weights_bytes(self.publish_dtype))

    def follow(self) -> None:
        for engine in self.engines.values():
            engine.load_weights(self.dir(self.version))


def honest(run: Run, publish_name: str, args: argparse.Namespace) -> list[float]:
    worst: list[float] = []
    for engine_name, engine in run.engines.items():
        for temperature, top_p in SETTINGS:
            delta = args.delta / temperature  # as the verifier applies it to logits / T
            groups = groups_of(run.trainer, engine, range(args.groups), run.version, seed=1,
                               temperature=temperature, top_p=top_p)
            tokens = sum(len(c) for g in groups for c in g.completions)
            pub, pub_out = gaps(run.published, run.trainer, groups, temperature, top_p, delta)
            mas, mas_out = gaps(run.trainer.model, run.trainer, groups, temperature, top_p, delta)
            full, near = logit_spread(engine.model, run.published, run.trainer, groups, temperature)
            refused = [int(group_refused(g, o, delta).sum()) for g, o in ((pub, pub_out), (mas, mas_out))]
            worst_gap = float(pub[pub.isfinite()].max().clamp(min=0))
            worst += [worst_gap * temperature, near * temperature]  # in logits, as δ is
            print(f"| {publish_name} | {engine_name} | {temperature:g} | {top_p:g} | {len(groups)} | {tokens} | "
                  f"{worst_gap:.3g} | {near:.3g} | {full:.3g} | {float(mas[mas.isfinite()].max().clamp(min=0)):.3g} | "
                  f"{int(pub_out.sum())}/{int(mas_out.sum())} | {refused[0]} / {refused[1]} |", flush=True)
    return worst


def attacks(run: Run, args: argparse.Namespace, root: Path) -> None:
    trainer, engine, n = run.trainer, run.engines["fp32"], args.groups
    lease = 7  # the seed the learner gave the lease
    other = TransformersEngine(write_tiny_model(root / "other", seed=1), threads=args.threads)

    def share(groups: list[Group]) -> str:
        shares = []
        for delta in args.attack_deltas:
            refused = group_refused(*gaps(run.published, trainer, groups, 1.0, 1.0, delta, seed=lease), delta)
            shares.append(f"{100 * float(refused.float().mean()):5.1f} %")
        return " | ".join(shares)

    def sampled(**kw) -> list[Group]:
        return groups_of(trainer, kw.pop("engine", engine), range(10_000, 10_000 + n), run.version,
                         seed=kw.pop("seed", lease), **{"temperature": 1.0, "top_p": 1.0, **kw})

    def best_of(k: int) -> list[Group]:
        draws = [sampled(seed=100 + d, sampler=None) for d in range(k)]
        out = []
        for i in range(n):  # per slot, the best of k draws by the task's own reward
            for slot in range(8):
                best = max(range(k), key=lambda d: draws[d][i].rewards[slot])
                draws[0][i].completions[slot] = draws[best][i].completions[slot]
                draws[0][i].behaviour_logprobs[slot] = draws[best][i].behaviour_logprobs[slot]
            out.append(draws[0][i])
        return out

    cases = {
        "honest (the lease's T, top_p and seed)": sampled(),
        "T 1.2 (lease: 1.0)": sampled(temperature=1.2),
        "T 0.8 (lease: 1.0)": sampled(temperature=0.8),
        "top_p 0.9 (lease: 1.0)": sampled(top_p=0.9),
        "greedy": sampled(temperature=0.0),
        "another model (seed 1 init), the lease's noise": sampled(engine=other),
        "its own generator, one draw": sampled(seed=99, sampler=None),
        "its own generator, best of 4 by reward": best_of(4),
        "an honest group of another lease, re-sent": sampled(seed=lease + 1),
    }
    print(f"\n== attacks: groups refused by the seeded-choice check (bf16 published, fp32 engine, lease T = 1, "
          f"top_p = 1, {n} groups of 8 each)")
    print("| peer | " + " | ".join(f"δ = {d:g}" for d in args.attack_deltas) + " |")
    print("|---|" + "---|" * len(args.attack_deltas))
    for name, groups in cases.items():
        print(f"| {name} | {share(groups)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--groups", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--delta", type=float, default=VerifyConfig().sample_tolerance)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--attack-deltas", type=lambda v: [float(x) for x in v.split(",")], default=[0.1, 0.25, 0.5])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sampler-") as tmp:
        root = Path(tmp)
        model = args.model or write_tiny_model(root / "model", seed=0, task="arith", warmup_steps=3000,
                                               warmup_accuracy=0.3)
        print(f"== honest groups at δ = {args.delta:g} (δ / T on logits / T, as the verifier): the choice gap under "
              "version t as published (what decides) and under the masters (the step's own forward); logit spread = "
              "max over positions of the range of (engine - learner) logits / T, over tokens with p >= 1e-4 and over "
              "the whole vocabulary; all in nats of logits / T")
        print("| published | engine | T | top_p | groups | tokens | max gap | spread p≥1e-4 | spread, all | "
              "max gap (masters) | flagged outside (published/masters) | groups refused (published / masters) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        worst: list[float] = []
        runs = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            runs[name] = Run(model, root / name, dtype, args)
            worst += honest(runs[name], name, args)
        print(f"\nlargest honest gap or logit spread over p >= 1e-4, published weights, in logits (× T): "
              f"{max(worst):.3g} nats")
        attacks(runs["bf16"], args, root)
        print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()

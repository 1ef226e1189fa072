"""Train a few GRPO steps on fixed batches and write what came out; run alone (W=1, plain trainer)
or under torchrun (W ranks, ShardedTrainer), so tests compare the two.

    python tests/helpers/sharded_steps.py MODEL OUT [--steps 5] [--train '{"micro_batch_sequences": 3}']
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/sharded_steps.py MODEL OUT

The batches: 4 groups of 4 completions drawn from the initial policy's vocabulary by a seeded RNG,
two of version 1 and two of version 2, with behaviour logprobs computed by the initial policy
(plain, on rank 0's CPU, before anything is sharded), so the learner's verification passes them:
weights_of(1) and weights_of(2) are both the initial weights. Steps train at versions 2, 3, ...,
so the groups are stale and the verifier's exact checks load versions 1 and 2 in turn into its
one spare model; --checkpoint writes a checkpoint after the steps,
--resume starts from one (at its version). OUT/result.json holds the per-step stats, OUT/initial.bin
the published bf16 bytes before training, OUT/final.safetensors the fp32 weights after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from echo2swarm.config.rl import TrainConfig, VerifyConfig  # noqa: E402
from echo2swarm.train.group import Group  # noqa: E402
from echo2swarm.learner.checkpoint import load_latest, save_checkpoint  # noqa: E402
from echo2swarm.train.distributed import make_trainer, serve_rank, world_size  # noqa: E402
from echo2swarm.train.trainer import GRPOTrainer  # noqa: E402
from tests.helpers.groups import with_own_logprobs  # noqa: E402


def fixed_groups(model_dir: Path, config: TrainConfig) -> list[Group]:
    plain = GRPOTrainer(model_dir, config.model_copy(update={"device": "cpu"}), verify=VerifyConfig(enabled=False))
    rng = random.Random(7)
    groups = []
    for g in range(4):
        prompt = plain.encode_prompt(f"{rng.randint(1, 99)}+{rng.randint(1, 99)}=")
        completions = [[rng.randrange(4, plain.vocab_size) for _ in range(rng.randint(2, 6))] for _ in range(4)]
        groups.append(Group(prompt_id=f"p{g}", version=1 + g // 2, prompt_ids=prompt, completions=completions,
                            behaviour_logprobs=[[0.0] * len(c) for c in completions],
                            rewards=[float(rng.random() < 0.5) + 0.1 * i for i in range(4)],
                            finish_reasons=["stop"] * 4))
    return with_own_logprobs(plain, groups)


VERIFIER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


class RemoteForward:
    """What a verifier daemon computes (train/exact.py `exact_figures`, streamed fp32 forward of the
    version's weights: here the initial ones for v1 and v2), called as the learner calls its verifiers."""

    def __init__(self, model_dir: Path, weights: dict) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from echo2swarm.train.streamed import StreamedPolicy, TensorWeights, parameters_on_meta

        with parameters_on_meta():
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
        self.model, self.weights, self.calls = StreamedPolicy(skeleton, device=torch.device("cpu")), TensorWeights(weights), 0

    def __call__(self, version, input_ids, attention_mask, completion_mask, keys, settings, need_bytes):
        from echo2swarm.train.exact import exact_figures

        self.calls += 1
        with self.model.use(self.weights), torch.no_grad():
            figures = exact_figures(self.model, input_ids.cpu(), attention_mask.cpu(), completion_mask.cpu(),
                                    None if keys is None else keys.cpu(), settings)
        figures.logprobs = figures.logprobs.cpu()
        return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--train", default="{}", help="TrainConfig fields, JSON")
    parser.add_argument("--resume", type=Path, help="run dir: resume from its latest checkpoint first")
    parser.add_argument("--checkpoint", type=Path, help="run dir: write a checkpoint after the steps")
    parser.add_argument("--remote", action="store_true",
                        help="exact checks through a verifier daemon's code (offload = always): rank 0 asks an "
                        "in-process CheckServer-like forward of the initial weights, the other ranks get its figures")
    args = parser.parse_args()
    config = TrainConfig(**{"device": "cpu", "lr": 2e-3, "kl_coef": 0.05, "seed": 3, **json.loads(args.train)})
    # Exact checks of two older versions: rank 0 streams each and sends the logits to the other rank.
    verify = VerifyConfig(seed=0, sample_fraction=1.0, spare_models=1)
    if args.remote:
        verify = verify.model_copy(update={"verifiers": [VERIFIER], "offload": "always"})
    rank = int(__import__("os").environ.get("RANK", "0"))
    if rank != 0:
        _exit(serve_rank(args.model, config, verify))
    groups = fixed_groups(args.model, config)
    initial = load_file(args.model / "model.safetensors")
    remote = RemoteForward(args.model, initial) if args.remote else None
    trainer = make_trainer(args.model, config, verify=verify, weights_of=lambda v: initial if v <= 2 else None,
                           remote=remote)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "initial.bin").write_bytes(trainer.weights_bytes(torch.bfloat16))
    first = 2
    if args.resume is not None:
        checkpoint = load_latest(args.resume)
        assert checkpoint is not None, f"no checkpoint in {args.resume}"
        checkpoint.restore(trainer)
        first = checkpoint.version
    steps = []
    for version in range(first, first + args.steps):
        stats = trainer.step(groups, current_version=version)
        stats.pop("refused_groups")
        steps.append({k: v for k, v in stats.items() if isinstance(v, (int, float))})
    save_file(trainer.weights_state(), str(args.out / "final.safetensors"))
    if args.checkpoint is not None:
        save_checkpoint(args.checkpoint, step=first + args.steps - 1, version=first + args.steps, trainer=trainer,
                        extra={}, keep=1)
    (args.out / "result.json").write_text(json.dumps({"world": world_size(), "steps": steps,
                                                      "remote_calls": remote.calls if remote else 0}))
    trainer.close()
    _exit(0)


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown: under load, torch's gloo threads have aborted a rank
    while Python finalised ("terminate called without an active exception", exit -6) after its work
    was done and written; the daemon's own exit is covered by the swarm and launch tests."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

"""A verification lab: a real trainer, its versions published to disk as the learner does, and a real
transformers engine that follows them (tests of train/verify.py and the seeded sampler)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.models.files import write_model_dir
from echo2swarm.rollout.engines.base import SamplingParams
from echo2swarm.rollout.engines.hf import TransformersEngine
from echo2swarm.tasks.arith import ArithTask
from echo2swarm.train.group import Group
from echo2swarm.train.grpo import completion_logits
from echo2swarm.train.scoring import score_logits, score_tokens
from echo2swarm.train.trainer import GRPOTrainer
from echo2swarm.train.verify import Verifier, VerifyResult
from echo2swarm.wire.sampling import SAMPLER

TASK = ArithTask(seed=0)


def write_peaked_model(source: Path, out: Path, scale: float) -> Path:
    """`source`'s model with its final norm scaled by `scale`: next-token distributions as peaked as a
    trained model's (the untrained tiny model's are nearly uniform, so little text is improbable and
    other samplers change few choices)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


class Lab:
    """A trainer, versions published to disk after each step as the learner does (in `publish_dtype`,
    None: the fp32 masters), and an engine that follows them."""

    def __init__(self, model_dir: Path, root: Path, *, verify: VerifyConfig | None = None, lr: float = 3e-4,
                 temperature: float = 1.0, top_p: float = 1.0, engine_dtype: torch.dtype = torch.float32,
                 group_size: int = 8, minibatches: int = 2, publish_dtype: torch.dtype | None = None):
        self.model_dir, self.root = model_dir, root
        self.publish_dtype = publish_dtype
        self.config = TrainConfig(device="cpu", lr=lr, temperature=temperature, top_p=top_p, group_size=group_size,
                                  threads=1, minibatches=minibatches,
                                  ppo_epochs=1 if minibatches == 1 else 2)
        self.trainer = GRPOTrainer(model_dir, self.config, verify=verify or VerifyConfig(seed=0),
                                   weights_of=self.weights_of)
        self.engine = TransformersEngine(model_dir, device="cpu", threads=1, dtype=engine_dtype)
        self.version = self.engine_version = 1
        self.publish()

    def dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def weights_of(self, version: int) -> Path | None:
        return self.dir(version) if self.dir(version).is_dir() else None

    def publish(self) -> None:
        write_model_dir(self.model_dir, self.dir(self.version), self.trainer.weights_bytes(self.publish_dtype))

    def follow(self, version: int) -> None:
        if self.engine_version != version:
            self.engine.load_weights(self.dir(version))
            self.engine_version = version

    def generate(self, indices: range | list[int], version: int, seed: int, peer: str = "honest", *,
                 seeded: bool = False, temperature: float | None = None, top_p: float | None = None,
                 engine: TransformersEngine | None = None) -> list[Group]:
        """Honest groups of `version` (or, with `temperature`, `top_p` or another `engine`, a peer that
        samples otherwise than the lease says and claims it did not). ``seeded``: with the lease's
        seeded sampler and `seed` as the lease's seed; the groups say so, as the intake records them."""
        if engine is None:
            self.follow(version)
        prompts = [TASK.prompt(i) for i in indices]
        params = SamplingParams(
            n=self.config.group_size, max_new_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature if temperature is None else temperature,
            top_p=self.config.top_p if top_p is None else top_p, seed=seed,
            sampler=SAMPLER if seeded else None, prompt_ids=tuple(p.prompt_id for p in prompts) if seeded else None)
        outputs = (engine or self.engine).generate([p.text for p in prompts], params)
        groups = [self.group(p.prompt_id, version, [c.token_ids for c in outs], [c.logprobs for c in outs],
                             [c.finish_reason for c in outs], peer) for p, outs in zip(prompts, outputs)]
        if seeded:
            for g in groups:
                g.sampler, g.seed = SAMPLER, seed
        return groups

    def group(self, prompt_id: str, version: int, completions: list[list[int]], logprobs: list[list[float]],
              finish: list[str], peer: str, rewards: list[float] | None = None) -> Group:
        index = int(prompt_id.split(":")[1])
        return Group(
            prompt_id=prompt_id, version=version, prompt_ids=self.trainer.encode_prompt(TASK.prompt(index).text),
            completions=completions, behaviour_logprobs=logprobs, finish_reasons=finish, peer_id=peer,
            rewards=rewards if rewards is not None else
            [TASK.reward(prompt_id, self.trainer.decode(c), f == "stop") for c, f in zip(completions, finish)],
        )

    def training_groups(self, indices: range, seed: int) -> list[Group]:
        """Honest groups of the current version with rewards 1, 0, 1, 0, ...: the untrained model
        never answers right, and a step on all-zero rewards would not move the policy."""
        groups = self.generate(indices, self.version, seed)
        for group in groups:
            group.rewards = [float(i % 2 == 0) for i in range(len(group.completions))]
        return groups

    def train(self, groups: list[Group]) -> dict:
        """A real step at the current version, then the next version is published."""
        stats = self.trainer.step(groups, current_version=self.version)
        self.version += 1
        self.publish()
        return stats

    def check(self, verifier: Verifier, groups: list[Group]) -> VerifyResult:
        """Verification alone (no training) at the current version, from the step's own forward."""
        batch = self.trainer.build_batch(groups)
        with torch.no_grad():
            scored = completion_logits(self.trainer.model, batch.input_ids, batch.attention_mask,
                                       batch.completion_mask, temperature=self.config.temperature)
            scores = score_logits(scored, top_p=self.config.top_p)
            return verifier.check(groups, self.trainer._group_rows(groups), current_version=self.version,
                                  input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                  completion_mask=batch.completion_mask, behaviour=batch.behaviour, scores=scores,
                                  logits=scored)

    def verifier(self, **config) -> Verifier:
        return Verifier(VerifyConfig(seed=0, **config), temperature=self.config.temperature, top_p=self.config.top_p,
                        weights_of=self.weights_of, make_spare=self.trainer._verify_spare)

    def true_logprobs(self, group: Group, version: int, *, renormalised: bool = True) -> Group:
        """`group` with the behaviour logprobs `version` really gives its tokens (teacher forcing):
        as the engines report them (renormalised over the top-p nucleus), or with ``renormalised=False``
        the full-softmax ones (how they were reported before the nucleus convention)."""
        model = self.trainer._spare_model()
        model.load_state_dict(load_file(self.dir(version) / "model.safetensors"), strict=False)
        batch = self.trainer.build_batch([group])
        scores = score_tokens(model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                              temperature=self.config.temperature, top_p=self.config.top_p, typicality=False)
        lp = scores.sampling_logprobs if renormalised else scores.logprobs
        group.behaviour_logprobs = [lp[r, lp.shape[1] - len(c):].tolist() for r, c in enumerate(group.completions)]
        return group

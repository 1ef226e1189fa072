"""One GRPO step on a batch of accepted groups, and the weights it produces.

    groups (prompt ids, completions, behaviour logprobs, rewards, version)
      ─► left-padded batch ─► advantages per group ─► token logprobs (with grad)
      ─► clipped objective (decoupled PPO when some groups are stale) ─► AdamW step

Runs in a worker thread of the learner daemon; nothing here touches the network. The policy, the
reference model, the optimizer state and every batch tensor live on `train.device`; published
weights and model directories are fp32 on the CPU wherever training runs.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo2swarm.config.rl import TrainConfig
from echo2swarm.learner.buffer import Group
from echo2swarm.learner.grpo import group_advantages, grpo_loss, token_logprobs
from echo2swarm.runtime.devices import resolve_device
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without tied duplicates (safetensors refuses shared storage)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.detach().contiguous()
    return out


class GRPOTrainer:
    """Holds the policy and its optimizer.

    >>> trainer = GRPOTrainer(Path("model"), TrainConfig())
    >>> stats = trainer.step(groups, current_version=7)
    >>> weights = trainer.weights_bytes()      # safetensors bytes for the next version
    """

    def __init__(self, model_dir: Path, config: TrainConfig):
        self.config = config
        self.device = resolve_device(config.device, setting="train.device (--device)")
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model = model.to(self.device)  # before the optimizer, so its state is created on the device
        self.model.train()
        logger.info("trainer: %s on %s (%d params, fp32)", self.model_dir, self.device,
                    sum(p.numel() for p in self.model.parameters()))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.reference = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every end-of-sequence id the generation config or tokenizer names (engines stop on any)."""
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else list(value or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def build_batch(self, groups: list[Group]) -> Batch:
        rows: list[tuple[list[int], list[int], list[float], float, int]] = []
        for group in groups:
            advantages = group_advantages(torch.tensor(group.rewards, dtype=torch.float32), scale_std=self.config.scale_std)
            for completion, logprobs, adv in zip(group.completions, group.behaviour_logprobs, advantages.tolist()):
                rows.append((group.prompt_ids, completion, logprobs, adv, group.version))
        length = max(len(p) + len(c) for p, c, *_ in rows)
        batch = len(rows)
        input_ids = torch.full((batch, length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, length), dtype=torch.long)
        completion_mask = torch.zeros((batch, length), dtype=torch.float32)
        behaviour = torch.zeros((batch, length), dtype=torch.float32)
        for b, (prompt, completion, logprobs, _, _) in enumerate(rows):
            seq = prompt + completion
            start = length - len(seq)  # left padding, as generation saw it
            input_ids[b, start:] = torch.tensor(seq)
            attention_mask[b, start:] = 1
            completion_mask[b, length - len(completion):] = 1
            behaviour[b, length - len(completion):] = torch.tensor(logprobs)
        # Assembled on the CPU (many small row writes), then moved in one copy per tensor.
        return Batch(
            input_ids, attention_mask, completion_mask, behaviour,
            torch.tensor([r[3] for r in rows], dtype=torch.float32),
            torch.tensor([r[4] for r in rows], dtype=torch.long),
        ).to(self.device)

    def step(self, groups: list[Group], current_version: int) -> dict[str, Any]:
        started = time.perf_counter()
        batch = self.build_batch(groups)
        temperature = self.config.temperature
        stale = bool((batch.versions < current_version).any())
        proximal = ref = None
        if stale or self.reference is not None:
            with torch.no_grad():
                if stale:  # decoupled PPO: clip against the current policy, re-weight by truncated IS
                    proximal = token_logprobs(self.model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                              temperature=temperature)
                if self.reference is not None:
                    ref = token_logprobs(self.reference, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                         temperature=temperature)
        logprobs = token_logprobs(self.model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                  temperature=temperature)
        loss, stats = grpo_loss(
            logprobs, batch.behaviour, batch.advantages, batch.completion_mask,
            clip_low=self.config.clip_low, clip_high=self.config.clip_high,
            proximal_logprobs=proximal, is_cap=self.config.is_cap, ref_logprobs=ref, kl_coef=self.config.kl_coef,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        return {
            **stats,
            "grad_norm": float(grad_norm),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "tokens": int(batch.completion_mask.sum()),
            "sequences": int(batch.input_ids.shape[0]),
            "stale_sequences": int((batch.versions < current_version).sum()),
            "t_train_s": time.perf_counter() - started,
        }

    def weights_bytes(self) -> bytes:
        """The policy as safetensors bytes: fp32, copied to the CPU when training runs elsewhere."""
        tensors = {name: t.to("cpu") for name, t in unique_state_dict(self.model).items()}
        return save_safetensors(tensors, metadata={"format": "pt"})

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        # load_state_dict copies into the existing parameters, so CPU tensors land on self.device.
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        # Names sharing storage with another (lm_head tied to the embeddings) are not in saved weights.
        tied = set(self.model.state_dict()) - set(unique_state_dict(self.model))
        if unexpected or set(missing) - tied:
            raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")

    def save_model_dir(self, out_dir: Path) -> Path:
        """A plain Hugging Face model directory of the current policy."""
        self.model.save_pretrained(out_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir

"""The update path of a GRPO step: from a verified batch and its proximal logprobs to optimizer updates.

    batch, proximal logprobs (trainer.py's first forward), kept groups
      ─► `train.max_offpolicy_gap`: groups too far off-policy leave the step
      ─► `ppo_epochs` passes over the kept groups shuffled into `minibatches` minibatches; with one
         minibatch, the first pass is the proximal forward's own loss (no forward of its own)
      ─► each minibatch's gradient accumulated over micro-batches (`train.micro_batch_sequences`),
         shared out across ranks under torchrun (train/distributed.py)
      ─► clip and AdamW step, skipped when the loss or the gradient norm is not finite

`UpdatePath` is a mixin of GRPOTrainer: it uses the trainer's model, reference, optimizer, config,
device, rank and world, and train/distributed.py's ShardedTrainer overrides its hooks
(`_gather_update`, `_clip_gradients`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from echo2swarm.config.rl import TrainConfig
from echo2swarm.train.batches import Batch
from echo2swarm.train.group import Group
from echo2swarm.train.grpo import LossOptions, grpo_loss, token_logprobs
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

__all__ = ["UpdatePath", "merge_updates"]


class UpdatePath:
    """GRPOTrainer's optimizer updates (see the module docstring); holds no state of its own."""

    config: TrainConfig
    device: torch.device
    model: torch.nn.Module
    reference: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    skipped_nonfinite: int
    rank: int
    world: int

    def _drop_offpolicy(self, groups: list[Group], rows: list[range], keep: list[bool], proximal: torch.Tensor,
                        batch: Batch) -> int:
        """`train.max_offpolicy_gap`: take out of `keep` every kept group whose mean per-token
        |proximal - behaviour| exceeds the threshold; returns how many."""
        limit = self.config.max_offpolicy_gap
        if limit is None:
            return 0
        mask = batch.completion_mask.bool()
        gap = torch.where(mask, (proximal - batch.behaviour).abs(), torch.zeros_like(proximal))
        dropped = 0
        for i, (group, span) in enumerate(zip(groups, rows)):
            if not keep[i]:
                continue
            tokens = mask[span.start:span.stop].sum()
            mean_gap = float(gap[span.start:span.stop].sum() / tokens.clamp(min=1))
            if mean_gap > limit:
                keep[i] = False
                dropped += 1
                logger.info("group %s from %s left the step: off-policy gap %.3f > %.3f (v%d)", group.prompt_id,
                            group.peer_id[-8:], mean_gap, limit, group.version)
        return dropped

    def _loss_options(self, step_tokens: float, minibatches: int) -> LossOptions:
        """The config's loss options; 'dapo' normalises by the step's tokens over the ``minibatches``
        each pass of the step makes (not the configured number: a step with fewer groups makes fewer)."""
        return LossOptions.from_config(self.config, global_tokens=max(step_tokens, 1.0) / minibatches)

    def _objective(self, logprobs: torch.Tensor, proximal: torch.Tensor | None, batch: Batch,
                   step_tokens: float, current_version: int) -> dict[str, float]:
        """Loss of an update on the whole batch from a forward already made (the proximal one), and the
        optimizer update it makes; returns its stats."""
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                     temperature=self.config.temperature)
        loss, stats = grpo_loss(logprobs, batch.behaviour, batch.advantages, batch.completion_mask,
                                proximal_logprobs=proximal, ref_logprobs=ref,
                                options=self._loss_options(step_tokens, minibatches=1))
        return {**stats, **self._update(loss, current_version)}

    def _minibatch_updates(self, batch: Batch, proximal: torch.Tensor, rows: list[range],
                           current_version: int, *, decoupled: bool = True,
                           first_done: bool = False) -> list[dict[str, float]]:
        """`ppo_epochs` passes, each over the kept groups shuffled into `minibatches` minibatches
        (clipped against ``proximal`` when ``decoupled``, else against the behaviour policy).
        ``first_done``: the first pass was one whole-batch update made from the proximal forward
        (trainer.py's `step`); the others follow."""
        config = self.config
        step_tokens = float(batch.completion_mask.sum())
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + current_version)
        parts = min(config.minibatches, len(rows))
        if first_done and parts != 1:
            raise ValueError(f"a whole-batch first update leaves no minibatches of its pass, got {parts}")
        out = []
        for epoch in range(config.ppo_epochs):
            order = torch.randperm(len(rows), generator=generator)
            if first_done and epoch == 0:
                continue
            for chunk in torch.tensor_split(order, parts):
                index = torch.tensor([i for g in chunk.tolist() for i in rows[g]], dtype=torch.long,
                                     device=self.device)
                sub, first = batch.select(index)
                sub_proximal = proximal.index_select(0, index)[:, first:] if decoupled else None
                out.append(self._accumulated_update(sub, sub_proximal, self._loss_options(step_tokens, parts),
                                                    current_version))
        return out

    def _micro_parts(self, rows: int) -> list[torch.Tensor | None]:
        """This rank's micro-batches of a minibatch of ``rows`` rows (row indices; None: a slot with
        no rows, run on row 0 with weight 0, so every rank makes the same number of forwards)."""
        size = self.config.micro_batch_sequences
        parts = -(-rows // size) if size else 1
        parts = -(-parts // self.world) * self.world  # a multiple of the ranks: each runs as many
        split = torch.tensor_split(torch.arange(rows), parts)
        return [p if p.numel() else None for p in split[self.rank::self.world]]

    @staticmethod
    def _normaliser_rows(batch: Batch, options: LossOptions) -> torch.Tensor:
        """Each row's share of the minibatch loss's normaliser (grpo.py's `_aggregate`): its completion
        tokens ('bnpo'), or 1 if it has any ('grpo', 'dr_grpo'); 'dapo' normalises by a constant."""
        tokens = batch.completion_mask.bool().sum(dim=1).to(torch.float64)
        return tokens if options.loss_type == "bnpo" else (tokens > 0).to(torch.float64)

    def _accumulated_update(self, batch: Batch, proximal: torch.Tensor | None, options: LossOptions,
                            current_version: int) -> dict[str, float]:
        """One optimizer update on a minibatch, its gradient accumulated over micro-batches (this
        rank's share of them). Each micro-batch's loss is weighted by its share of the minibatch's
        normaliser, so the sum is the minibatch's loss: the same gradient as one forward of it, for
        every loss option (tests/unit/train/test_trainer_loss.py). Stats are token-weighted means over
        the micro-batches."""
        config = self.config
        norm = self._normaliser_rows(batch, options)
        total = float(norm.sum())
        tokens = batch.completion_mask.sum(dim=1).to(torch.float64)
        all_tokens = max(float(tokens.sum()), 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        gap_max, finite = 0.0, True
        for rows in self._micro_parts(int(batch.input_ids.shape[0])):
            index = (rows if rows is not None else torch.zeros(1, dtype=torch.long)).to(self.device)
            sub, first = batch.select(index)
            sub_proximal = proximal.index_select(0, index)[:, first:] if proximal is not None else None
            lp = token_logprobs(self.model, sub.input_ids, sub.attention_mask, sub.completion_mask,
                                temperature=config.temperature)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.reference, sub.input_ids, sub.attention_mask, sub.completion_mask,
                                         temperature=config.temperature)
            loss, stats = grpo_loss(lp, sub.behaviour, sub.advantages, sub.completion_mask,
                                    proximal_logprobs=sub_proximal, ref_logprobs=ref, options=options)
            if rows is None:
                weight = share = 0.0
            else:
                weight = 1.0 if options.loss_type == "dapo" else float(norm[index].sum()) / max(total, 1e-30)
                share = float(tokens[index].sum()) / all_tokens
            ok = rows is None or bool(torch.isfinite(loss.detach()))
            finite = finite and ok
            # Every rank runs every backward (FSDP reduces gradients in it), finite or not; one
            # process skips a non-finite one. FSDP averages gradients over ranks: times `world`.
            if ok or self.world > 1:
                (loss * (weight * self.world)).backward()
            if rows is not None:
                for key, value in stats.items():
                    if key == "offpolicy_gap_max":
                        gap_max = max(gap_max, value)
                    else:
                        sums[key] = sums.get(key, 0.0) + (weight if key == "loss" else share) * value
        finite, sums, gap_max = self._gather_update(finite, sums, gap_max)
        return {**sums, "offpolicy_gap_max": gap_max, **self._apply_update(finite, sums.get("loss", 0.0),
                                                                            current_version)}

    def _gather_update(self, finite: bool, sums: dict[str, float], gap_max: float
                       ) -> tuple[bool, dict[str, float], float]:
        """Across ranks (ShardedTrainer): every rank's loss finite, stat sums added, gap max taken."""
        return finite, sums, gap_max

    def _clip_gradients(self) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)

    def _apply_update(self, finite_loss: bool, loss: float, current_version: int) -> dict[str, float]:
        """Clip and step the accumulated gradient; no update (and a loud log) when a loss or the
        gradient norm is not finite (the same decision on every rank: both are global)."""
        grad_norm = torch.tensor(float("nan"))
        if finite_loss:
            grad_norm = self._clip_gradients()
        if finite_loss and bool(torch.isfinite(grad_norm)):
            self.optimizer.step()
            return {"grad_norm": float(grad_norm), "skipped_nonfinite": 0}
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_nonfinite += 1
        logger.error(
            "update at v%d SKIPPED: loss %s, gradient norm %s (not finite); weights and optimizer state unchanged "
            "(%d such updates so far)", current_version, loss, float(grad_norm), self.skipped_nonfinite,
        )
        return {"grad_norm": float(grad_norm), "skipped_nonfinite": 1}

    def _update(self, loss: torch.Tensor, current_version: int) -> dict[str, float]:
        """Backward, clip and step; no update (and a loud log) when the loss or gradient is not finite.
        A NaN or inf would reach every weight through the gradient clip and AdamW."""
        self.optimizer.zero_grad(set_to_none=True)
        finite_loss = bool(torch.isfinite(loss.detach()))
        if finite_loss:
            loss.backward()
        return self._apply_update(finite_loss, float(loss.detach()), current_version)

    def _idle_stats(self, verify_stats: dict[str, Any], started: float) -> dict[str, Any]:
        """Stats of a step that trained nothing (every group refused): same keys, zero values."""
        return {
            "loss": 0.0, "clip_frac": 0.0, "ratio_mean": 1.0, "kl": 0.0, "is_weight_mean": 1.0,
            "is_truncated_frac": 0.0, "is_masked_frac": 0.0, "is_ess": 1.0, "offpolicy_gap_mean": 0.0,
            "offpolicy_gap_max": 0.0, "updates": 0, "grad_norm": 0.0, "reward_mean": 0.0, "reward_std": 0.0,
            "tokens": 0, "sequences": 0, "stale_sequences": 0, "skipped_nonfinite": 0, **verify_stats,
            "t_train_s": time.perf_counter() - started,
        }


def merge_updates(updates: list[dict[str, float]]) -> dict[str, Any]:
    """One step's stats from its updates' stats: means, except the max gap, the count of skips, and
    ``clip_frac``, the mean over the updates after the first: the first starts at the proximal policy
    (ratio 1), so it never clips, and a mean with it would halve the share at the default 2 x 1."""
    out: dict[str, Any] = {}
    for key in updates[0]:
        values = [u[key] for u in updates]
        if key == "clip_frac":
            later = values[1:] or values
            out[key] = sum(later) / len(later)
        elif key == "offpolicy_gap_max":
            out[key] = max(values)
        elif key == "skipped_nonfinite":
            out[key] = int(sum(values))
        else:
            out[key] = sum(values) / len(values)
    out["updates"] = len(updates)
    return out

"""The learner across ranks: one policy sharded with FSDP2 over W processes (torchrun), one daemon.

    rank 0: daemon (DHT, leases, intake, publisher, chunk service) ─► ShardedTrainer.step(groups, v)
               │ broadcast_object_list(("step", groups, v)) on the command group (gloo, CPU)
               ▼
    rank 1..W-1: serve(): receive a command ─► the same method ─► its collectives ─► next command

Every rank holds 1/W of the parameters, gradients and AdamW moments (`fully_shard` per decoder
layer and on the root; bf16 compute with fp32 master weights and reductions when
`train.mixed_precision` says so). Every rank gets the whole batch and takes the same decisions
(verification, off-policy drops, minibatch order: same data, same seeds); the forwards that only
score (proximal, reference, verification's older versions) run on the whole batch on every rank,
and each update's micro-batches are handed out across the ranks (`GRPOTrainer._micro_parts`), their
gradients reduce-scattered by FSDP. The non-finite skip is global: every rank's loss finite and the
global gradient norm finite, or no rank steps.

Rank 0 answers the trainer API the daemon uses (`step`, `weights_state`, `weights_bytes`,
`load_weights`, `save_state`, `load_state`, `save_model_dir`, `optimizer`: train/base.py's `Trainer`); each
call first tells the other ranks what to do. Published weights are gathered to rank 0's CPU
tensor by tensor (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`): never the full
model twice on a device. Back-pressure: rank 0's step waits for the slowest rank.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from echo2swarm.config.rl import TrainConfig, VerifyConfig
from echo2swarm.train.exact import CheckUnavailable, ExactFigures, ExactSettings, RemoteCheck
from echo2swarm.train.group import Group
from echo2swarm.train.rounding import ROUND_TO_NEAREST, held_cast
from echo2swarm.train.trainer import GRPOTrainer, train_without_dropout, unique_state_dict
from echo2swarm.train.streamed import StreamedPolicy, VersionWeights, buffers_to, parameters_on_meta
from echo2swarm.train.verify import WeightsOf, check_finite
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

__all__ = ["Ranks", "ShardedTrainer", "init_ranks", "make_trainer", "serve_rank", "world_size"]

# Workers wait on the command group while rank 0 waits for rollouts (the bubble): a long timeout.
# A dead rank is noticed by its peers' broken connections and by torchrun, not by this timeout.
COMMAND_TIMEOUT = timedelta(days=7)
_MEAN_STATS = ("loss", "clip_frac", "ratio_mean", "kl", "is_weight_mean", "is_truncated_frac", "is_masked_frac",
               "is_ess", "offpolicy_gap_mean")


def world_size() -> int:
    """Ranks of this learner, from torchrun's environment (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Ranks:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    commands: Any  # the gloo process group commands and small objects travel on (CPU)


def init_ranks(device_setting: str) -> Ranks:
    """Join torchrun's process group: NCCL for CUDA tensors, gloo for the CPU and for commands.

    Each rank trains on ``cuda:LOCAL_RANK`` when ``train.device`` is auto or cuda and CUDA is
    visible, else on the CPU.
    """
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if device_setting.startswith("cuda:"):
        raise ValueError(f"train.device = {device_setting!r} with {world} ranks: each rank takes cuda:LOCAL_RANK; "
                         "set train.device (--device) to auto or cuda")
    cuda = device_setting in ("auto", "cuda") and torch.cuda.is_available()
    if device_setting == "cuda" and not cuda:
        raise ValueError("train.device = 'cuda' but no CUDA device is visible; set train.device to cpu")
    if cuda:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    logger.info("learner rank %d of %d on %s", rank, world, device)
    return Ranks(rank, world, local, device, commands)


def make_trainer(model_dir: Path, config: TrainConfig, *, verify: VerifyConfig | None = None,
                 weights_of: WeightsOf | None = None, remote: RemoteCheck | None = None) -> GRPOTrainer:
    """The trainer of this process: a plain GRPOTrainer, or rank 0's ShardedTrainer under torchrun.
    ``remote``: where exact checks may run instead (verifier daemons: learner/verifiers.py)."""
    if world_size() <= 1:
        return GRPOTrainer(model_dir, config, verify=verify, weights_of=weights_of, remote=remote)
    return ShardedTrainer(model_dir, config, ranks=init_ranks(config.device), verify=verify, weights_of=weights_of,
                          remote=remote)


def serve_rank(model_dir: Path, config: TrainConfig, verify: VerifyConfig | None = None) -> int:
    """A non-zero rank's whole life: build the shards, follow rank 0's commands until it says stop."""
    ranks = init_ranks(config.device)
    trainer = ShardedTrainer(model_dir, config, ranks=ranks, verify=verify)
    trainer.serve()
    dist.destroy_process_group()
    return 0


def shard_model(model: torch.nn.Module, mesh: Any, *, bf16: bool) -> torch.nn.Module:
    """`fully_shard` each decoder layer (the model's `_no_split_modules`), then the root."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    kinds = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
                         "the sharded learner needs one to shard by")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # The root too gives its gathered parameters back after each forward (FSDP2 keeps them by
    # default, for the backward): scoring forwards have no backward, and the state-dict calls
    # need every parameter sharded.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP module of ``model`` back to its shards (after a forward that had no backward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class ShardedTrainer(GRPOTrainer):
    """GRPOTrainer over FSDP2 shards; rank 0 drives, the others `serve()`.

    >>> trainer = ShardedTrainer(Path("model"), TrainConfig(), ranks=init_ranks("auto"))
    >>> if trainer.rank == 0:
    ...     stats = trainer.step(groups, current_version=7)   # every rank takes part
    ...     weights = trainer.weights_bytes()                  # gathered on rank 0's CPU
    ...     trainer.close()                                    # the other ranks' serve() returns
    ... else:
    ...     trainer.serve()
    """

    def __init__(self, model_dir: Path, config: TrainConfig, *, ranks: Ranks, verify: VerifyConfig | None = None,
                 weights_of: WeightsOf | None = None, remote: RemoteCheck | None = None):
        self.ranks = ranks
        self.rank, self.world = ranks.rank, ranks.world
        self.mesh = init_device_mesh(ranks.device.type, (ranks.world,))
        self.bf16 = config.mixed_precision == "bf16" or (config.mixed_precision == "auto"
                                                          and ranks.device.type == "cuda")
        self._lock = threading.RLock()
        self._closed = False  # close() ran: the other ranks were told to stop, the group is gone
        self._weights_of_rank0 = weights_of
        verify = verify if verify is not None else VerifyConfig()
        if verify.enabled and verify.seed is None:  # the sample of exact checks must be the same on every rank
            verify = verify.model_copy(update={"seed": self._from_rank0(random.SystemRandom().randrange(2**31))})
        self._remote_rank0 = remote
        # Every rank takes part in each exact check the same way: rank 0 asks the verifier daemons and
        # tells the others what came back (the config, the same on every rank, says whether there are any).
        on_ranks = self._remote_on_ranks if verify.verifiers and verify.offload != "never" else None
        super().__init__(model_dir, config, verify=verify, weights_of=self._weights_of, remote=on_ranks)

    # -- building ------------------------------------------------------------------------------
    def _resolve_device(self) -> torch.device:
        return self.ranks.device

    def _sharded(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.config.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return shard_model(model, self.mesh, bf16=self.bf16)

    def _from_model_dir(self) -> torch.nn.Module:
        """Rank 0's weights in every rank's shards: rank 0 reads the model directory, the others
        build the architecture from its config.json and receive the weights from rank 0."""
        if self.rank == 0:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir), dtype=torch.float32)
        self._names = set(unique_state_dict(model))  # what a full state holds: tied duplicates left out
        self._tied = set(model.state_dict()) - self._names
        full = unique_state_dict(model) if self.rank == 0 else {}
        model = self._sharded(model)
        self._load_full(model, full)
        return model

    def _load_policy(self) -> torch.nn.Module:
        model = self._from_model_dir()
        params = sum(p.numel() for p in model.parameters())  # DTensors: their global sizes
        train_without_dropout(model)
        logger.info("trainer: %s sharded over %d ranks on %s (%d params, %s compute, fp32 master weights)",
                    self.model_dir, self.world, self.device, params, "bf16" if self.bf16 else "fp32")
        return model

    def _load_reference(self) -> torch.nn.Module:
        reference = self._from_model_dir()
        reference.requires_grad_(False)
        return reference.eval()

    def _verify_spare(self) -> torch.nn.Module:
        """Older versions for the verifier: rank 0 streams them through an unsharded skeleton (one
        module's weights at a time, fp32, on its device) and sends the logits to the other ranks."""
        streamed = None
        if self.rank == 0:
            with parameters_on_meta():
                skeleton = AutoModelForCausalLM.from_config(self.model.config, dtype=torch.float32)
            streamed = StreamedPolicy(buffers_to(skeleton, self.device), device=self.device)
        return _StreamedOnRanks(streamed, self)

    # -- collectives ---------------------------------------------------------------------------
    def _from_rank0(self, value: Any) -> Any:
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.ranks.commands)
        return box[0]

    def _send(self, name: str, *args: Any) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{name} is rank 0's to call; rank {self.rank} follows in serve()")
        self._from_rank0((name, args))

    def _weights_of(self, version: int) -> VersionWeights | dict[str, torch.Tensor] | None:
        """Version ``version``'s weights for the verifier, agreed on every rank: rank 0 opens them
        (headers checked, no tensor read), the others learn whether there are any and get an empty
        dict (`_StreamedOnRanks` reads on rank 0 only)."""
        found: Any = None
        if self.rank == 0 and self._weights_of_rank0 is not None:
            try:
                found = self._weights_of_rank0(version)
                if isinstance(found, (str, Path)):
                    found = VersionWeights(found)
            except Exception as e:  # a store mid-collection, a file gone or damaged: no exact check, not a crash
                logger.warning("verify: weights of v%d unavailable (%s: %s)", version, type(e).__name__, e)
                found = None
        available = self._from_rank0(found is not None)
        return (found if self.rank == 0 else {}) if available else None

    def _remote_on_ranks(self, version: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         completion_mask: torch.Tensor, keys: torch.Tensor | None, settings: ExactSettings,
                         need_bytes: int) -> ExactFigures | None:
        """Rank 0's verifier daemons' figures (CPU tensors), on every rank; None on every rank when it
        declined; CheckUnavailable on every rank when it found the check can run nowhere."""
        figures: Any = None
        if self.rank == 0 and self._remote_rank0 is not None:
            try:
                figures = self._remote_rank0(version, input_ids, attention_mask, completion_mask, keys, settings,
                                             need_bytes)
            except CheckUnavailable as e:
                figures = str(e)
        figures = self._from_rank0(figures)
        if isinstance(figures, str):
            raise CheckUnavailable(figures)
        return figures

    def _load_full(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Rank 0's full ``tensors`` into every rank's shards of ``model`` (ValueError on every rank
        when they do not fit the policy)."""
        problem = None
        if self.rank == 0:
            missing, unexpected = sorted(self._names - set(tensors)), sorted(set(tensors) - self._names - self._tied)
            if missing or unexpected:
                problem = f"missing {missing}, unexpected {unexpected}"
        problem = self._from_rank0(problem)
        if problem:
            raise ValueError(problem)
        full = {n: t.to(torch.float32) for n, t in tensors.items()} if self.rank == 0 else {}
        reshard(model)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                   strict=False))

    def _gather_update(self, finite: bool, sums: dict[str, float], gap_max: float
                       ) -> tuple[bool, dict[str, float], float]:
        summed = torch.tensor([0.0 if finite else 1.0, *(sums.get(k, 0.0) for k in _MEAN_STATS)], dtype=torch.float64)
        dist.all_reduce(summed, group=self.ranks.commands)
        top = torch.tensor([gap_max], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.ranks.commands)
        return bool(summed[0] == 0), dict(zip(_MEAN_STATS, summed[1:].tolist())), float(top[0])

    def _clip_gradients(self) -> torch.Tensor:
        """The global gradient norm (the same on every rank), and the clip it implies."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, self.config.grad_clip, norm)
        return norm

    # -- rank 0's API (each call tells the other ranks first) -------------------------------------
    def step(self, groups: list[Group], current_version: int) -> dict[str, Any]:
        with self._lock:
            self._send("step", groups, current_version)
            return super().step(groups, current_version)

    def weights_state(self, dtype: torch.dtype | None = None, hold_from: dict[str, torch.Tensor] | None = None,
                      hold_ulps: float = ROUND_TO_NEAREST) -> dict[str, torch.Tensor]:
        """The full policy on rank 0's CPU, cast to ``dtype`` (None: fp32) as GRPOTrainer.weights_state
        does (holding values of ``hold_from``), finite-checked; gathered tensor by tensor, so no
        device ever holds the whole model."""
        hold_from = hold_from or {}
        with self._lock:
            self._send("weights")
            state = self._gather_full()
        out: dict[str, torch.Tensor] = {}
        for name in list(state):  # cast one tensor at a time: the fp32 state shrinks as the cast one grows
            tensor = state.pop(name)
            out[name] = (held_cast(tensor, hold_from.get(name), dtype, hold_ulps) if dtype is not None
                         else tensor).contiguous()
        check_finite(out)
        return out

    def _gather_full(self) -> dict[str, torch.Tensor]:
        reshard(self.model)
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {n: t for n, t in state.items() if n not in self._tied} if self.rank == 0 else {}

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._send("load")
            try:
                self._load_full(self.model, tensors)
            except ValueError as e:
                raise ValueError(f"checkpoint does not fit the model: {e}") from None

    def reset_optimizer(self) -> None:
        with self._lock:
            self._send("reset_optimizer")
            super().reset_optimizer()

    def assert_finite(self) -> None:
        with self._lock:
            self._send("finite")
            self._all_finite()

    def _all_finite(self) -> None:
        bad = sum(int(not bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()))
                  for p in self.model.parameters())
        count = torch.tensor([bad], dtype=torch.long)
        dist.all_reduce(count, group=self.ranks.commands)
        if self.rank == 0 and int(count[0]):
            check_finite({"any shard": torch.tensor([float("nan")])})

    def save_state(self, path: Path) -> None:
        with self._lock:
            self._send("save_state", str(path))
            self._save_local(path)

    def load_state(self, path: Path) -> None:
        with self._lock:
            self._send("load_state", str(path))
            self._load_local(path)

    def _save_local(self, path: Path) -> None:
        reshard(self.model)
        GRPOTrainer.save_state(self, Path(path))

    def _load_local(self, path: Path) -> None:
        reshard(self.model)
        GRPOTrainer.load_state(self, Path(path))

    def save_model_dir(self, out_dir: Path) -> Path:
        """A Hugging Face model directory of the policy, written by rank 0 from the gathered weights."""
        state = self.weights_state()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        self.model.config.save_pretrained(out_dir)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir

    def close(self) -> None:
        """Tell the other ranks to stop (rank 0, once training is over), then leave the process group:
        one still alive at interpreter exit can abort the process ("terminate called without an active
        exception" from gloo's threads), which torchrun reports as a failed rank."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._send("stop")
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the other ranks -----------------------------------------------------------------------
    def serve(self) -> None:
        """Follow rank 0's commands until it says stop (ranks 1..W-1)."""
        handlers = {
            "step": lambda groups, version: GRPOTrainer.step(self, groups, version),
            "weights": self._gather_full,
            "load": lambda: self._load_full(self.model, {}),
            "reset_optimizer": lambda: GRPOTrainer.reset_optimizer(self),
            "finite": self._all_finite,
            "save_state": self._save_local,
            "load_state": self._load_local,
        }
        while True:
            name, args = self._from_rank0(None)
            if name == "stop":
                logger.info("rank %d: stop from rank 0", self.rank)
                return
            try:
                handlers[name](*args)
            except ValueError as e:  # raised on every rank before any collective (weights that do not fit)
                logger.warning("rank %d: %s failed on every rank: %s", self.rank, name, e)


class _StreamedOnRanks(torch.nn.Module):
    """The verifier's view of older versions on W ranks: rank 0's `StreamedPolicy` runs each forward,
    and every rank returns the logits rank 0 computed, so all ranks judge the same (a failure on rank
    0 raises on every rank, before or after its forward)."""

    def __init__(self, streamed: StreamedPolicy | None, trainer: ShardedTrainer):
        super().__init__()
        self.streamed = streamed  # rank 0 only
        self._trainer = [trainer]  # in a list: not a submodule

    @property
    def buffer_bytes(self) -> int:
        """Rank 0's: the ranks' estimates of a forward's memory must agree, and only rank 0 streams."""
        return self.streamed.buffer_bytes if self.streamed is not None else 0

    @contextmanager
    def use(self, weights: Any) -> Iterator[_StreamedOnRanks]:
        trainer = self._trainer[0]
        with ExitStack() as stack:
            problem = None
            if self.streamed is not None:
                try:
                    stack.enter_context(self.streamed.use(weights))
                except ValueError as e:
                    problem = str(e)
            problem = trainer._from_rank0(problem)
            if problem:
                raise ValueError(problem)
            yield self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False, logits_to_keep: int = 0) -> Any:
        trainer = self._trainer[0]
        logits, shape = None, None
        if self.streamed is not None:
            try:
                logits = self.streamed(input_ids, attention_mask, position_ids, use_cache, logits_to_keep).logits
                logits = logits.float().contiguous()
                shape = tuple(logits.shape)
            except Exception as e:  # every rank must leave this forward the same way
                logger.warning("verify: rank 0's forward of an older version failed: %s: %s", type(e).__name__, e)
        shape = trainer._from_rank0(shape)
        if shape is None:
            raise RuntimeError("verify: rank 0 could not compute an older version's logits (its log says why)")
        if logits is None:
            logits = torch.empty(shape, dtype=torch.float32, device=trainer.device)
        dist.broadcast(logits, src=0)  # the default group: NCCL for CUDA tensors, gloo on the CPU
        return SimpleNamespace(logits=logits)

"""Run a published version's forward without a copy of its weights: a module's weights are read from
the version's files just before that module runs and dropped right after.

The verifier's exact check (train/verify.py) needs the logits of older versions. A resident copy of
the policy per version costs 4 bytes a parameter in fp32 (32 GB for an 8B policy); this costs, during
the forward only, one buffer per distinct parameter shape (an 8B Qwen3: a decoder layer's 0.8 GB and
the embedding's, which the lm_head reuses, 2.5 GB, in fp32) and one read of the version's files per
forward, from the page cache when they were read lately:

    StreamedPolicy(policy)           a skeleton of the policy: every parameter on the meta device (no
                                     memory), buffers (rotary tables) copied, tied parameters still tied
      .use(VersionWeights(dir))      whose files the next forwards read
      forward ─► per module with parameters, before it runs: each parameter's tensor read from the
                 files (plain reads through one staging buffer, no memory map) into a buffer of
                 its shape in the policy's dtype, on its device
              ─► after it runs: the parameters are meta again, their buffers free for the next
                 module of the same shape

`VersionWeights` reads tensors by name from a directory's ``*.safetensors`` files, every header checked
(runtime/safetensors.py: dtypes, shapes, ranges inside the file, no overlaps) before any tensor is read. A parameter used outside
its own module's forward would meet a meta tensor: `StreamedPolicy` raises then, naming it, rather
than computing on nothing.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from echo2swarm.runtime.safetensors import safetensors_layout

__all__ = ["StreamedPolicy", "Streaming", "TensorWeights", "VersionWeights", "buffers_to", "parameters_on_meta"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # every dtype of runtime/safetensors.py ITEMSIZE


@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    end: int


class VersionWeights:
    """The tensors of a model directory's ``*.safetensors`` files, read one at a time.

    ValueError when a file is not safetensors or a header entry does not fit its file (the learner
    wrote these files itself, but a disk can still hand back something else)."""

    def __init__(self, model_dir: Path | str):
        self.dir = Path(model_dir)
        self.entries: dict[str, _Entry] = {}
        self._staging: torch.Tensor | None = None
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.dir}: no *.safetensors weights")
        for path in files:
            self.entries.update(_layout(path))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` copied into ``out`` (its shape; any dtype and device: cast on the copy).
        The file's bytes pass through one staging buffer, kept for the next read (page-locked when
        ``out`` is on a GPU, which then gets the file's dtype and casts there)."""
        entry = self.entries[name]
        size = entry.end - entry.start
        pinned = out.device.type == "cuda"
        if self._staging is None or len(self._staging) < size or self._staging.is_pinned() != pinned:
            self._staging = None  # the old one's memory first
            self._staging = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pinned)
        raw = self._staging[:size]
        with open(entry.path, "rb") as f:
            f.seek(entry.start)
            if f.readinto(raw.numpy()) != size:
                raise ValueError(f"{entry.path.name}: tensor {name!r} ends past the file's end")
        if size:
            tensor = raw.view(entry.dtype).reshape(entry.shape)
            # A GPU: the file's bytes over (synchronously: the staging buffer is reused next), cast there.
            out.copy_(tensor.to(out.device) if pinned and entry.dtype != out.dtype else tensor)
        return out


class TensorWeights:
    """Tensors already in memory (tests, tools), read like a `VersionWeights`."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.dir = "tensors"

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.tensors[name])


@runtime_checkable
class Streaming(Protocol):
    """What the verifier streams older versions through: `StreamedPolicy`, or the sharded trainer's
    rank-0 form of it (train/distributed.py)."""

    def use(self, weights: Any) -> Any: ...


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built within get their parameters on the meta device (no memory, initialisers do
    nothing) and their buffers as usual: a skeleton for `StreamedPolicy` from a config alone."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _layout(path: Path) -> dict[str, _Entry]:
    """A file's tensors by name (runtime/safetensors.py checks the header), in torch's dtypes."""
    return {name: _Entry(path, _DTYPES[slot.dtype], tuple(slot.shape), slot.start, slot.end)
            for name, slot in safetensors_layout(path, os.path.getsize(path)).items()}


def buffers_to(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` with its buffers on ``device`` (its parameters may be on the meta device)."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = buffer.to(device)
    return module


class StreamedPolicy(torch.nn.Module):
    """The policy's architecture over the weights of a `VersionWeights`, read module by module.

    >>> streamed = StreamedPolicy(policy)             # no parameter memory
    >>> with streamed.use(VersionWeights(store.dir(5))):
    ...     logits = streamed(input_ids=ids, attention_mask=attn).logits

    A forward outside `use` raises RuntimeError. Within one `use`, a module's buffers serve the next
    module of the same shape, so a forward allocates each shape once: the memory it holds is the
    largest set of distinct shapes loaded together (a decoder layer's, the embedding, the head).
    """

    def __init__(self, policy: torch.nn.Module, device: torch.device | None = None):
        """``device``: where the parameters are loaded (default: where each of the policy's lives; a
        policy whose parameters are on the meta device needs one, and its buffers should be there)."""
        super().__init__()
        memo: dict[int, Any] = {}
        where: dict[int, tuple[torch.dtype, torch.device]] = {}
        for p in policy.parameters():
            skeleton = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
            memo[id(p)] = skeleton
            where[id(skeleton)] = (p.dtype, device if device is not None else p.device)
            if where[id(skeleton)][1].type == "meta":
                raise ValueError("StreamedPolicy: the policy's parameters are on the meta device; pass device=")
        self.inner = copy.deepcopy(policy, memo).eval()  # buffers copied; parameters the meta skeletons
        self.inner.requires_grad_(False)
        aliases: dict[int, list[str]] = {}  # a parameter's names (several when tied)
        for name, p in self.inner.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self._slots: list[tuple[torch.nn.Module, str, list[str], torch.nn.Parameter, torch.dtype, torch.device]] = []
        self._weights: VersionWeights | TensorWeights | None = None
        # Buffers of the modules that ran, by (shape, dtype, device), for the next module of that shape
        # within one `use`: a model's layers share a few shapes, so a forward allocates each once.
        self._free: dict[tuple, list[torch.Tensor]] = {}
        for prefix, module in self.inner.named_modules():
            own = [(local, p) for local, p in module._parameters.items() if p is not None]
            if not own:
                continue
            slots = []
            for local, p in own:
                full = f"{prefix}.{local}" if prefix else local
                names = [full] + [n for n in aliases[id(p)] if n != full]
                dtype, device = where[id(p)]
                slots.append((module, local, names, p, dtype, device))
            self._slots.extend(slots)
            module.register_forward_pre_hook(self._loader(slots))
            module.register_forward_hook(self._unloader(slots))

    @property
    def buffer_bytes(self) -> int:
        """Bytes a forward allocates at most for parameters: one buffer per distinct shape, dtype and device."""
        shapes = {(tuple(skeleton.shape), dtype, device) for _, _, _, skeleton, dtype, device in self._slots}
        return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype, _ in shapes)

    @contextmanager
    def use(self, weights: VersionWeights | TensorWeights) -> Iterator[StreamedPolicy]:
        """Forwards within read ``weights``. ValueError before any forward when they lack a parameter of
        the policy or hold one in another shape."""
        missing, misshapen = [], []
        for _, _, names, skeleton, *_ in self._slots:
            name = next((n for n in names if n in weights), None)
            if name is None:
                missing.append(names[0])
            elif tuple(weights.shape(name)) != tuple(skeleton.shape):
                misshapen.append(f"{name} {tuple(weights.shape(name))} (policy: {tuple(skeleton.shape)})")
        if missing or misshapen:
            raise ValueError(f"{weights.dir}: " + "; ".join(
                f"{what} {len(names)} parameter(s) of the policy: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                for what, names in (("no tensor for", missing), ("another shape for", misshapen)) if names))
        self._weights = weights
        try:
            yield self
        finally:
            self._weights = None
            self._free.clear()
            for module, local, _, skeleton, *_ in self._slots:
                module._parameters[local] = skeleton  # a forward that raised left some loaded

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False, logits_to_keep: int = 0) -> Any:
        """The policy's forward (``logits_to_keep`` declared, so callers keep only the logits they need)."""
        if self._weights is None:
            raise RuntimeError("StreamedPolicy: call it within `with streamed.use(weights):`")
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": use_cache}
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        out = self.inner(input_ids=input_ids, **kwargs)
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.is_meta:
            raise RuntimeError("StreamedPolicy: the policy used a parameter outside its own module's forward")
        return out

    def _loader(self, slots: list) -> Any:
        def load(module: torch.nn.Module, _inputs: Any) -> None:
            weights = self._weights
            if weights is None:
                raise RuntimeError("StreamedPolicy: call it within `with streamed.use(weights):`")
            for _, local, names, skeleton, dtype, device in slots:
                name = next(n for n in names if n in weights)  # `use` checked there is one, of this shape
                free = self._free.get((skeleton.shape, dtype, device))
                buffer = free.pop() if free else torch.empty(skeleton.shape, dtype=dtype, device=device)
                module._parameters[local] = torch.nn.Parameter(weights.read_into(name, buffer), requires_grad=False)
        return load

    def _unloader(self, slots: list) -> Any:
        def unload(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
            for _, local, _, skeleton, dtype, device in slots:
                loaded = module._parameters[local]
                module._parameters[local] = skeleton
                if loaded is not None and not loaded.is_meta:
                    self._free.setdefault((skeleton.shape, dtype, device), []).append(loaded.data)
        return unload

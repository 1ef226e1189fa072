"""How fp32 master weights become the published weights: round to nearest, or hold (publish.hold_ulps).

Round-to-nearest republishes a weight whenever its master crosses a rounding boundary, and a
master that hovers near one flips the published value back and forth from version to version:
bytes in every delta for no lasting change. Holding keeps the published value p of the previous
version until the master m is more than `hold_ulps` of p's own ulps away from it, then publishes
m rounded to nearest:

    d = |m - p| / |n - p|,   n = p's neighbour on m's side (one step of the 16-bit format)
    published = round(m)  if d > hold_ulps  else  p

hold_ulps = 0.5 is round-to-nearest (ties aside); 1.0 lets a published weight lag its master by
up to one ulp instead of half of one. The rule decides only *which* values are published: the
wire format, the hashes and the followers do not change, and learner and peers still run and
measure logprobs against exactly the published bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HOLDABLE = (torch.bfloat16, torch.float16)
ROUND_TO_NEAREST = 0.5
PUBLISHABLE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def publish_dtype(setting: str, model_dir: Path | None = None) -> torch.dtype:
    """`publish.dtype` as a torch dtype: ``auto`` is the model directory's own (config.json's
    ``dtype`` or ``torch_dtype``; float32 when it names none)."""
    if setting == "auto":
        config = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir is not None else {}
        own = config.get("dtype") or config.get("torch_dtype")
        setting = str(own).removeprefix("torch.") if own else "float32"
    dtype = PUBLISHABLE.get(setting)
    if dtype is None:
        raise ValueError(f"publish.dtype: the model's dtype {setting!r} is not one we publish; "
                         "set publish.dtype to bfloat16, float16 or float32")
    return dtype


def held_cast(master: torch.Tensor, previous: torch.Tensor | None, dtype: torch.dtype,
              hold_ulps: float) -> torch.Tensor:
    """`master` in `dtype`, keeping `previous`'s values where the master is within `hold_ulps` of them.

    Round-to-nearest (a plain cast) when there is no previous value to hold, the rule is off
    (hold_ulps <= 0.5), the dtype is not a 16-bit float, or the shapes differ.
    """
    cast = master.to(dtype)
    if (previous is None or hold_ulps <= ROUND_TO_NEAREST or dtype not in HOLDABLE
            or previous.dtype != dtype or previous.shape != master.shape):
        return cast
    m = master.to(torch.float32)
    p = previous.to(torch.float32)
    magnitude = previous.view(torch.int16).to(torch.int32) & 0x7FFF
    # one step away from zero when m lies beyond p (or p is zero), one step towards zero otherwise
    away = (p == 0) | ((m > p) == (p > 0))
    neighbour = (magnitude + torch.where(away, 1, -1)).to(torch.int16).view(dtype).to(torch.float32)
    gap = (neighbour - p.abs()).abs()
    # a cast that overflows (float16) is published as is, so the finiteness check refuses it
    held = ((m - p).abs() <= hold_ulps * gap) & cast.isfinite()
    return torch.where(held, previous, cast)


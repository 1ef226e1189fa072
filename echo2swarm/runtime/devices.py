"""Torch device names for the learner's trainer and the transformers engine, and the cores an engine may use.

A device setting is ``"auto"`` (the first CUDA device when one is visible, else the CPU),
``"cpu"``, ``"cuda"`` or ``"cuda:N"``. The config checks the spelling without importing torch
(`check_device_name`), so `echo2swarm --help` stays instant; `resolve_device` turns it into a
``torch.device`` and fails, naming the setting, when the CUDA device it asks for is not there.

    >>> resolve_device("auto")                    # device(type='cpu') on a machine without CUDA
    >>> resolve_device("cuda", setting="train.device (--device)")
    ValueError: train.device (--device) is 'cuda' but no CUDA device is visible ...
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_CHOICES", "check_device_name", "resolve_device"]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(value: str) -> str:
    """``value`` if it is a device setting we accept, else ValueError listing the choices."""
    if not isinstance(value, str) or not _DEVICE_NAME.fullmatch(value):
        raise ValueError(f"must be one of {DEVICE_CHOICES} (N: a CUDA device index), got {value!r}")
    return value


def resolve_device(value: str | torch.device, *, setting: str = "device") -> torch.device:
    """The ``torch.device`` for a device setting; ValueError naming ``setting`` when it cannot be had."""
    import torch

    if isinstance(value, torch.device):
        value = str(value)
    try:
        check_device_name(value)
    except ValueError as e:
        raise ValueError(f"{setting} {e}") from None
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(value)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{setting} is {value!r} but no CUDA device is visible (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                f"set {setting} to cpu or auto, or fix the GPU driver / torch build"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{setting} is {value!r} but only {count} CUDA device(s) are visible "
                             f"(cuda:0 .. cuda:{count - 1})")
    return device


def check_cpus(cpus: list[int] | None) -> set[int] | None:
    """``cpus`` as a set, after checking that this machine has every one of them.

    Not checked against this process's own affinity: a daemon pinned to core 0 may run its engine
    on core 1. A core the container's cpuset withholds is refused when the host pins itself.
    """
    if cpus is None:
        return None
    if not cpus:
        raise ValueError("engine.cpus is empty; list the cores the engine may use, or leave it unset")
    present = set(range(os.cpu_count() or 1))
    missing = sorted(set(cpus) - present)
    if missing:
        raise ValueError(f"engine.cpus names cores {missing} this machine does not have; it has {format_cores(present)}")
    return set(cpus)


def format_cores(cores: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``, for messages."""
    out, ordered = [], sorted(cores)
    start = prev = ordered[0]
    for core in ordered[1:] + [None]:  # type: ignore[list-item]
        if core is not None and core == prev + 1:
            prev = core
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(out)

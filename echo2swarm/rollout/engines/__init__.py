"""Rollout engines behind one Protocol, and the factory that picks one.

Heavy imports (torch, transformers, vllm) happen only when an engine is built, so importing this
package stays cheap for the CLI.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2swarm.rollout.engines.base import ENGINE_KINDS, Completion, Engine, FinishReason, SamplingParams
from echo2swarm.runtime.logging import get_logger

if TYPE_CHECKING:
    from echo2swarm.rollout.engines.hf import TransformersEngine
    from echo2swarm.rollout.engines.vllm import VLLMEngine

logger = get_logger(__name__)

__all__ = [
    "ENGINE_KINDS",
    "Completion",
    "Engine",
    "FinishReason",
    "SamplingParams",
    "check_engine_installed",
    "make_engine",
    "vllm_installed",
]


def vllm_installed() -> bool:
    """Whether a vllm package is installed (not imported: that takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    # A bare directory named vllm on sys.path is a namespace package with no origin, not vLLM.
    return spec is not None and spec.origin is not None


def check_engine_installed(kind: str) -> None:
    """Raise ValueError, naming the extra to install, when ``kind`` cannot work here at all.

    Cheap (no import): meant for start-up checks. A vLLM that is installed but broken is caught
    when the engine is built.
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of: {', '.join(ENGINE_KINDS)}")
    if kind == "vllm" and not vllm_installed():
        from echo2swarm.rollout.engines.vllm import VLLM_INSTALL_HINT

        raise ValueError(f"engine 'vllm' was requested but vllm is not installed: {VLLM_INSTALL_HINT}")


def make_engine(
    kind: str,
    model_dir: Path,
    *,
    threads: int | None = None,
    max_batch_sequences: int | None = None,
    vllm_options: dict[str, Any] | None = None,
    **transformers_options: Any,
) -> Engine:
    """Build the engine named by ``kind`` on ``model_dir``.

    ``"auto"`` picks vLLM when it imports here, else transformers, and logs which and why.
    ``vllm_options`` go to :class:`VLLMEngine` only, ``transformers_options`` to
    :class:`TransformersEngine` only; ``threads`` and ``max_batch_sequences`` (None: the engine's
    default, `engine.max_batch_sequences`'s) to either.

    Example::

        engine = make_engine("auto", Path("models/tiny"), threads=2)
    """
    check_engine_installed(kind)
    if not (Path(model_dir) / "config.json").is_file():  # else each library reports it as a bad hub repo id
        raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json there)")
    chosen, why = kind, ""
    if kind in ("auto", "vllm"):
        from echo2swarm.rollout.engines.vllm import import_vllm

        try:
            import_vllm()
            chosen = "vllm"
        except ImportError as e:
            if kind == "vllm":
                raise RuntimeError(f"engine 'vllm' was requested but {e}") from e
            chosen, why = "transformers", f"; vllm unusable: {e}"
    logger.info("rollout engine: %s (asked for %r%s)", chosen, kind, why)
    batch = {} if max_batch_sequences is None else {"max_batch_sequences": max_batch_sequences}
    if chosen == "vllm":
        from echo2swarm.rollout.engines.vllm import VLLMEngine

        if transformers_options.get("device", "auto") not in ("auto", "cuda"):
            logger.warning("engine.device=%s is not used by vLLM, which picks its own device "
                           "(choose a GPU with CUDA_VISIBLE_DEVICES)", transformers_options["device"])
        return VLLMEngine(Path(model_dir), threads=threads, **batch, **(vllm_options or {}))
    from echo2swarm.rollout.engines.hf import TransformersEngine

    return TransformersEngine(Path(model_dir), threads=threads, **batch, **transformers_options)


def __getattr__(name: str) -> type[TransformersEngine] | type[VLLMEngine]:
    # Lazy so that `from echo2swarm.rollout.engines import SamplingParams` imports neither torch nor vllm.
    if name == "TransformersEngine":
        from echo2swarm.rollout.engines.hf import TransformersEngine

        return TransformersEngine
    if name == "VLLMEngine":
        from echo2swarm.rollout.engines.vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

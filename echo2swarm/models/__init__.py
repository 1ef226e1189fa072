"""The tiny local model (`tiny.py`) and its supervised warm-up (`warmup.py`), for the demo and tests;
`kv_cache.py` hands a causal LM its KV cache across transformers releases; `files.py` writes a model
directory from a template's files and new weights (the benchmarks' and tests' labs)."""

from echo2swarm.models.tiny import build_char_tokenizer, build_tiny_model, tiny_config, write_tiny_model

__all__ = ["build_char_tokenizer", "build_tiny_model", "tiny_config", "write_tiny_model"]

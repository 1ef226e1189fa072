"""Model builders for the echo2swarm daemon."""

from echo2swarm.models.tiny import build_char_tokenizer, build_tiny_model, tiny_config, write_tiny_model

__all__ = ["build_char_tokenizer", "build_tiny_model", "tiny_config", "write_tiny_model"]

"""Tiny character-level Qwen3 causal LM and tokenizer, built entirely offline.

The swarm's tests and local smoke runs need a real Hugging Face model
directory (config, safetensors weights, tokenizer) without network access or
a model hub. This module synthesises one: a ~300k-parameter Qwen3 over a
49-symbol character vocabulary that is enough for arithmetic-style prompts
such as ``"12+3="``.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from echo2swarm.models import warm_cache

logger = logging.getLogger(__name__)

__all__ = [
    "CHARSET",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_tiny_model",
    "tiny_config",
    "write_tiny_model",
]

CHARSET: str = "0123456789" + "+-*=?:,. " + "abcdefghijklmnopqrstuvwxyz"

SPECIAL_TOKENS: tuple[str, str, str, str] = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = SPECIAL_TOKENS

# Shared by the model config and the tokenizer so truncation matches the RoPE range.
MAX_POSITIONS: int = 128


def _vocab() -> dict[str, int]:
    """Special tokens take ids 0..3 so pad/bos/eos/unk ids are stable constants."""
    tokens = list(SPECIAL_TOKENS) + list(CHARSET)
    if len(set(tokens)) != len(tokens):
        raise AssertionError("CHARSET contains duplicate characters")
    return {token: index for index, token in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level fast tokenizer.

    Every character (space included) becomes exactly one token; characters
    outside :data:`CHARSET` map to ``<unk>``. No BOS/EOS is added
    automatically; callers add them explicitly where they want them.
    """
    backend = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=UNK_TOKEN))
    # `[\s\S]` rather than `.`: Oniguruma's `.` skips newlines, so a run of
    # them would stay one piece (one <unk>) and break one-id-per-character.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # The default decoder joins tokens with spaces, which would corrupt the
    # round trip; Fuse concatenates them verbatim.
    backend.decoder = decoders.Fuse()

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        # Passing these explicitly makes transformers install an empty
        # TemplateProcessing post-processor instead of guessing one.
        add_bos_token=False,
        add_eos_token=False,
        # Cleanup would strip the space in e.g. "1 ," and break exact round trips.
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
        # Decoder-only generation needs left padding for batched prompts.
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )
    return tokenizer


def tiny_config(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
) -> Qwen3Config:
    """Return a small Qwen3 config (about 300k parameters at the defaults)."""
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    num_kv_heads = 2
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}")
    special_ids = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        # transformers 5.x uses `dtype`; `torch_dtype` is only a deprecated alias.
        dtype=torch.float32,
        bos_token_id=special_ids[BOS_TOKEN],
        eos_token_id=special_ids[EOS_TOKEN],
        pad_token_id=special_ids[PAD_TOKEN],
    )


def build_tiny_model(
    seed: int = 0, **config_overrides: Any
) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """Build a freshly initialised tiny model and its tokenizer.

    Initialisation is a pure function of ``seed`` and the config; the caller's
    global torch RNG state is left untouched.
    """
    tokenizer = build_char_tokenizer()
    config = tiny_config(vocab_size=len(tokenizer), **config_overrides)
    # Only the CPU generator is forked: the model is built on CPU, and forking
    # CUDA state would initialise CUDA needlessly on GPU hosts.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype=torch.float32)
    model.eval()
    return model, tokenizer


def write_tiny_model(
    out_dir: str | os.PathLike[str], seed: int = 0, *, task: str | None = None, warmup_steps: int = 0,
    warmup_accuracy: float | None = None, task_options: dict[str, Any] | None = None, **config_overrides: Any,
) -> pathlib.Path:
    """Write a tiny model as a standard Hugging Face directory and return its path.

    Writes ``config.json``, ``generation_config.json``, a single
    ``model.safetensors`` and the tokenizer files. Output is deterministic for
    a given ``seed``. Refuses to write into an existing non-empty directory so
    it can never clobber a real checkpoint. With ``task`` and ``warmup_steps``,
    the model first gets a short seeded supervised warm-up on that task: RL
    post-training starts from a model that sometimes answers right; with ``warmup_accuracy`` too,
    ``warmup_steps`` is a cap and the warm-up stops once greedy accuracy on train prompts reaches
    it (how many steps that takes varies with the CPU: see models/warmup.py); ``task_options`` are the
    task's own (as in ``[train] task_options``). ``config_overrides`` go to
    `tiny_config` (``hidden_size``, ``num_layers``, ``num_heads``): a larger model of the same family.
    A warmed-up model is kept in the machine's cache (models/warm_cache.py) and copied from there the
    next time the same recipe is asked for.
    """
    path = pathlib.Path(out_dir)
    if path.exists():
        if not path.is_dir():
            raise FileExistsError(f"{path} exists and is not a directory")
        if any(path.iterdir()):
            raise FileExistsError(f"refusing to write tiny model into non-empty directory {path}")
    path.mkdir(parents=True, exist_ok=True)
    warm = task is not None and warmup_steps > 0
    recipe = {"seed": seed, "task": task, "task_options": dict(task_options or {}), "warmup_steps": warmup_steps,
              "warmup_accuracy": warmup_accuracy, "config": config_overrides}
    if warm and warm_cache.lookup(recipe, path) is not None:
        logger.info("wrote tiny model (seed=%d, warmed up on %s, from the cache) to %s", seed, task, path)
        return path

    model, tokenizer = build_tiny_model(seed=seed, **config_overrides)
    result = None
    if warm:
        from echo2swarm.models.warmup import supervised_warmup
        from echo2swarm.tasks.registry import get_task

        warmup_task = get_task(task, seed=seed, **(task_options or {}))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            result = supervised_warmup(model, tokenizer, warmup_task, steps=warmup_steps, seed=seed,
                                       until_accuracy=warmup_accuracy)
        model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if result is not None:
        warm_cache.store(recipe, path, result)
    logger.info("wrote tiny model (seed=%d, %d params) to %s", seed, model.num_parameters(), path)
    return path

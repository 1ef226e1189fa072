"""Tests for the offline tiny Qwen3 model and character tokenizer."""

from __future__ import annotations

import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo2swarm.models.tiny import (
    CHARSET,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    build_tiny_model,
    write_tiny_model,
)


def test_tokenizer_round_trip_one_id_per_char_no_bos_eos() -> None:
    tokenizer = build_char_tokenizer()
    text = "12+3=15? a, b: 7*8-1. z  "

    ids = tokenizer(text)["input_ids"]

    assert len(ids) == len(text)
    assert ids == [len(SPECIAL_TOKENS) + CHARSET.index(ch) for ch in text]
    assert tokenizer.bos_token_id not in ids
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.unk_token_id == 3

    # Explicitly added specials must be stripped on decode without touching the text.
    wrapped = [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
    assert tokenizer.decode(wrapped, skip_special_tokens=True) == text


def test_tokenizer_unknown_char_maps_to_unk() -> None:
    tokenizer = build_char_tokenizer()

    ids = tokenizer("1A#\n2")["input_ids"]

    unk = tokenizer.unk_token_id
    assert ids == [tokenizer.convert_tokens_to_ids("1"), unk, unk, unk, tokenizer.convert_tokens_to_ids("2")]


def test_parameter_count_at_defaults() -> None:
    model, tokenizer = build_tiny_model()

    n_params = sum(p.numel() for p in model.parameters())

    assert 250_000 <= n_params <= 450_000
    assert model.config.vocab_size == len(tokenizer)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training


def test_build_does_not_disturb_global_rng() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)

    build_tiny_model(seed=7)

    assert torch.equal(torch.rand(4), expected)


def test_write_is_deterministic_per_seed(tmp_path: pathlib.Path) -> None:
    first = write_tiny_model(tmp_path / "a", seed=3)
    second = write_tiny_model(tmp_path / "b", seed=3)
    other = write_tiny_model(tmp_path / "c", seed=4)

    first_bytes = (first / "model.safetensors").read_bytes()
    assert first_bytes == (second / "model.safetensors").read_bytes()
    assert first_bytes != (other / "model.safetensors").read_bytes()


def test_written_dir_loads_offline_and_matches(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    out_dir = write_tiny_model(tmp_path / "tiny", seed=0)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out_dir / name).is_file(), name
    reference, reference_tokenizer = build_tiny_model(seed=0)

    model = AutoModelForCausalLM.from_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model.eval()

    text = "12+3= ab"
    ids = tokenizer(text)["input_ids"]
    assert ids == reference_tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text

    input_ids = torch.tensor([[tokenizer.bos_token_id, *ids]])
    with torch.no_grad():
        loaded_logits = model(input_ids=input_ids).logits
        reference_logits = reference(input_ids=input_ids).logits
    assert loaded_logits.dtype == torch.float32
    assert torch.equal(loaded_logits, reference_logits)

    with torch.no_grad():
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=4,
            do_sample=False,
        )
    assert generated.shape[0] == 1
    assert input_ids.shape[1] < generated.shape[1] <= input_ids.shape[1] + 4
    assert torch.equal(generated[:, : input_ids.shape[1]], input_ids)


def test_write_refuses_non_empty_dir(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "occupied"
    target.mkdir()
    (target / "keep.txt").write_text("do not clobber")

    with pytest.raises(FileExistsError, match="non-empty"):
        write_tiny_model(target)

    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]

"""The KV cache goes to forward under the keyword this transformers release takes: no deprecation
warning on every decoding step, and decoding with it gives the logits a full forward gives."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from echo2swarm.models.kv_cache import kv_cache, kv_cache_keyword
from echo2swarm.models.tiny import build_tiny_model
from echo2swarm.models.warmup import greedy_complete

pytestmark = pytest.mark.timeout(60)


def test_decoding_with_the_cache_warns_nothing_and_matches_a_full_forward() -> None:
    model, tokenizer = build_tiny_model(seed=0)
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        model(input_ids=ids[:, :-1], use_cache=True, **kv_cache(model, cache))
        step = model(input_ids=ids[:, -1:], use_cache=True, **kv_cache(model, cache)).logits[0, -1]
        full = model(input_ids=ids).logits[0, -1]
    assert not [str(w.message) for w in caught if "cache" in str(w.message).lower()]
    assert torch.allclose(step, full, atol=1e-5)
    assert cache.get_seq_length() == ids.shape[1]


def test_the_keyword_is_read_from_the_forward_signature() -> None:
    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert kv_cache_keyword(New) == "cache" and kv_cache_keyword(Old) == "past_key_values"
    assert kv_cache(Old(), "c") == {"past_key_values": "c"}


def test_greedy_decoding_warns_nothing() -> None:
    model, tokenizer = build_tiny_model(seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        greedy_complete(model, tokenizer, ["1+2=", "33+44="], max_new_tokens=4)
    assert not [str(w.message) for w in caught if "cache" in str(w.message).lower()]

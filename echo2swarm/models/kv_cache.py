"""Hand a causal LM its KV cache under the keyword its transformers release expects.

transformers 5.2x renamed `forward(past_key_values=...)` to `forward(cache=...)` (5.24 has it, 5.19
not). The old name still works there but warns on every call (removal is announced for 5.40), and
earlier releases (4.51 and up, which pyproject admits) know only the old one. The warning is not
only noise: under pytest's warning capture each one is recorded, which made a 20 s warm-up take
136 s. Callers build their own `DynamicCache`, so outputs are never read back under either name.

    cache = DynamicCache(config=model.config)
    model(input_ids=ids, use_cache=True, **kv_cache(model, cache))
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["kv_cache", "kv_cache_keyword"]


@functools.lru_cache(maxsize=None)
def kv_cache_keyword(model_class: type) -> str:
    """`cache` where `model_class.forward` takes it, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def kv_cache(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model``'s forward (see `kv_cache_keyword`)."""
    return {kv_cache_keyword(type(model)): cache}

"""The fetch and publish fields of delta versions and head long-polls: defaults, ranges, and errors
that name the field to change."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from echo2swarm.config.models import FetchConfig, PublishConfig


def test_defaults():
    fetch, publish = FetchConfig(), PublishConfig()
    assert fetch.head_wait_s == 10.0 and fetch.delta_order_items == 2**27
    # chunk_size is 'auto' by default (64 KiB .. 8 MiB, resolved per version): never below the delta chunks
    assert publish.delta_chunk_size == 64 * 1024 and publish.chunk_size == "auto"


@pytest.mark.parametrize("field, value", [("head_wait_s", -1), ("head_wait_s", 301), ("delta_order_items", -1),
                                          ("delta_order_items", 2**41)])
def test_fetch_fields_out_of_range_are_refused(field: str, value: float):
    with pytest.raises(ValidationError, match=field):
        FetchConfig(**{field: value})


def test_head_wait_zero_turns_the_long_poll_off_and_orders_zero_turns_sorting_ahead_off():
    config = FetchConfig(head_wait_s=0, delta_order_items=0)
    assert config.head_wait_s == 0 and config.delta_order_items == 0


def test_delta_chunk_size_takes_units_and_stays_within_16kib_64mib_and_the_chunk_size():
    assert PublishConfig(delta_chunk_size="32KiB").delta_chunk_size == 32 * 1024
    for bad in ("8KiB", "65MiB"):
        with pytest.raises(ValidationError, match="delta_chunk_size must be between 16KiB and 64MiB"):
            PublishConfig(delta_chunk_size=bad)
    with pytest.raises(ValidationError, match=r"publish.delta_chunk_size \(1048576\) must be at most publish.chunk_size"):
        PublishConfig(chunk_size="512KiB", delta_chunk_size="1MiB")
    assert PublishConfig(chunk_size="64KiB", delta_chunk_size="64KiB").delta_chunk_size == 64 * 1024

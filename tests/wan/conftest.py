"""WAN-lab tests: skipped with the reason where namespaces cannot be built; REQUIRE_NETNS=1 (CI) fails instead."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers.wanlab import WanLab, unavailable


@pytest.fixture
def lab() -> Iterator[WanLab]:
    reason = unavailable()
    if reason:
        if os.environ.get("REQUIRE_NETNS") == "1":
            pytest.fail(f"REQUIRE_NETNS=1 but the WAN lab cannot be built here: {reason}")
        pytest.skip(reason)
    lab = WanLab()
    try:
        yield lab
    finally:
        lab.close()
        assert not lab.leftovers(), f"namespaces left behind: {lab.leftovers()}"

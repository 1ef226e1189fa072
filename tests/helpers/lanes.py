"""Lanes for the suite's pytest-xdist workers (`make test`: `-n 2 --dist loadscope`).

    collection (each worker) ─► order(items): heavy modules first, then modules that start daemons, then the rest
    scheduler (the controller) ─► Lanes: one scope per module, one scope for every heavy module together

A module's tests run together on one worker, so a module's shared swarm starts once. The heavy modules
(tests/conftest.py CPU_HEAVY: they keep more than a core busy for a long while) share one scope, so
they run one after another on one worker and never starve each other's timing of CPU, while the other
worker takes the remaining modules, longest kinds first; short unit modules fill the gaps at the end.

xdist's own `--dist loadgroup` would say the same with marks, but it renames items (`_nodeid`), which
pytest 9 no longer reads: the groups silently vanish. The scheduler hook sees only node ids, so the
heavy modules are named by path.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pytest

HEAVY_LANE = "cpu-heavy"


def lane(nodeid: str, heavy: Collection[str]) -> str:
    module = nodeid.split("::", 1)[0]
    return HEAVY_LANE if module in heavy else module


def make_scheduler(config: pytest.Config, log: Any, heavy: Collection[str]) -> Any:
    """The `pytest_xdist_make_scheduler` of `--dist loadscope`: lanes as scopes, in collection order."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid, heavy)

    config.option.loadscopereorder = False  # the order of `order`, not "most tests first"
    return Lanes(config, log)


def order(items: list[pytest.Item], heavy: Collection[str]) -> None:
    """Sort in place, whole modules at a time (a module's tests stay together and in their order)."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        mine = 0 if module in heavy else 1 if item.get_closest_marker("swarm") or item.get_closest_marker("slow") else 2
        rank[module] = min(mine, rank.get(module, 2))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])

"""Lanes for the suite's pytest-xdist workers (`-n 2 --dist loadscope`; `make test` runs one process).

    collection (each worker) ─► order(items): heavy modules first, then modules that start daemons, then
                                the rest, then the modules that run alone, the light ones last
    scheduler (the controller) ─► Lanes: one scope per module, one scope for every heavy module together

A module's tests run together on one worker, so a module's shared swarm starts once. The heavy modules
(tests/conftest.py CPU_HEAVY: they keep more than a core busy for a long while) share one scope, so
they run one after another on one worker and never starve each other's timing of CPU, while the other
worker takes the remaining modules, longest kinds first.
The modules that run alone (tests/conftest.py ALONE: they compare the learner's step rate before and
during an attack, or the demo's reward over its steps, which a swarm starting on the other worker would
skew) run one after another on one worker, once every other worker runs only light modules (tests/unit,
tests/bench: one process, about a core, no daemons: a steady neighbour) or has exited.

xdist's own `--dist loadgroup` would say the same with marks, but it renames items (`_nodeid`), which
pytest 9 no longer reads: the groups silently vanish. The scheduler hook sees only node ids, so the
heavy modules are named by path.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pytest

HEAVY_LANE = "cpu-heavy"
ALONE = "alone:"  # the scope of a module that runs alone


def lane(nodeid: str, heavy: Collection[str], alone: Collection[str] = ()) -> str:
    module = nodeid.split("::", 1)[0]
    return ALONE + module if module in alone else HEAVY_LANE if module in heavy else module


def is_light(scope: str, light: Collection[str]) -> bool:
    """A module under one of the `light` folders: one process on about one core, no daemons."""
    return any(scope.startswith(prefix) for prefix in light)


def make_scheduler(config: pytest.Config, log: Any, heavy: Collection[str], alone: Collection[str] = (),
                   light: Collection[str] = ()) -> Any:
    """The `pytest_xdist_make_scheduler` of `--dist loadscope`: lanes as scopes, in collection order."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid, heavy, alone)

        def _assign_work_unit(self, node: Any) -> None:
            # Beside a module that runs alone only light modules run, and it starts only once every other
            # worker runs light modules or nothing. The queue holds the heavy lane and the modules that
            # start daemons, then those that run alone, then the light ones: a worker kept from the next
            # module that runs alone takes light ones meanwhile. A worker left with nothing it may take
            # (only modules that run alone are left, and another worker runs one or is still busy) is told
            # to finish and exit (a worker runs its last test only once it is sent more or told to stop).
            elsewhere = [scope for other, work in self.assigned_work.items() if other is not node
                         for scope, tests in work.items() if not all(tests.values())]
            alone_elsewhere = any(scope.startswith(ALONE) for scope in elsewhere)
            busy_elsewhere = any(not scope.startswith(ALONE) and not is_light(scope, light) for scope in elsewhere)
            for scope in self.workqueue:
                if is_light(scope, light):
                    break
                if scope.startswith(ALONE) and not (alone_elsewhere or busy_elsewhere):
                    break
                if not scope.startswith(ALONE) and not alone_elsewhere:
                    break
            else:
                if not node.shutting_down:
                    node.shutdown()
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def remove_node(self, node: Any) -> Any:
            crashed = super().remove_node(node)
            for other in list(self.assigned_work):  # a worker kept from a module that runs alone asks again
                self._reschedule(other)
            return crashed

    config.option.loadscopereorder = False  # the order of `order`, not "most tests first"
    return Lanes(config, log)


def order(items: list[pytest.Item], heavy: Collection[str], alone: Collection[str] = (),
          light: Collection[str] = ()) -> None:
    """Sort in place, whole modules at a time (a module's tests stay together and in their order): the
    heavy lane, modules that start daemons, other modules, those that run alone, the light ones."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        mine = (3 if module in alone else 0 if module in heavy else 4 if is_light(module, light)
                else 1 if item.get_closest_marker("swarm") or item.get_closest_marker("slow") else 2)
        rank[module] = min(mine, rank.get(module, 4))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])

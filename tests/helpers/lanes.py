"""Lanes for the suite's two pytest-xdist workers (`make test`: `-n 2 --dist loadscope`).

    collection (each worker) ─► order(items): heavy modules first, then modules that start daemons (those
                                kept apart first), then the rest, then the modules that run alone, the
                                light ones last
    scheduler (the controller) ─► Lanes: one scope per module, one scope for every heavy module together

A module's tests run together on one worker, so a module's shared swarm starts once. The heavy modules
(tests/conftest.py CPU_HEAVY: they keep more than a core busy for a long while) share one scope, so
they run one after another on one worker and never starve each other's timing of CPU, while the other
worker takes the remaining modules, longest kinds first.
The modules that run alone (tests/conftest.py ALONE: they compare the learner's step rate before and
during an attack, or the demo's reward over its steps, which a swarm starting on the other worker would
skew) run one after another on one worker, once every other worker runs only light modules (tests/unit,
tests/bench: one process, about a core, no daemons: a steady neighbour) or has exited. The modules kept
apart (tests/conftest.py APART: paced step-rate comparisons) run beside anything but the heavy lane.

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
APART = "apart:"  # the scope of a module that never runs beside the heavy lane


def lane(nodeid: str, heavy: Collection[str], alone: Collection[str] = (), apart: Collection[str] = ()) -> str:
    module = nodeid.split("::", 1)[0]
    if module in alone:
        return ALONE + module
    if module in apart:
        return APART + module
    return HEAVY_LANE if module in heavy else module


def is_light(scope: str, light: Collection[str]) -> bool:
    """A module under one of the `light` folders: one process on about one core, no daemons."""
    return any(scope.startswith(prefix) for prefix in light)


def make_scheduler(config: pytest.Config, log: Any, heavy: Collection[str], alone: Collection[str] = (),
                   light: Collection[str] = (), apart: Collection[str] = ()) -> Any:
    """The `pytest_xdist_make_scheduler` of `--dist loadscope`: lanes as scopes, in collection order."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid, heavy, alone, apart)

        def _allowed(self, scope: str, elsewhere: list[str]) -> bool:
            """May `scope` start now, beside the unfinished scopes of the other workers?"""
            if is_light(scope, light):
                return True
            if any(s.startswith(ALONE) for s in elsewhere):
                return False
            if scope.startswith(ALONE):
                return all(is_light(s, light) for s in elsewhere)
            if scope.startswith(APART):
                return HEAVY_LANE not in elsewhere
            return scope != HEAVY_LANE or not any(s.startswith(APART) for s in elsewhere)

        def _assign_work_unit(self, node: Any) -> None:
            # The queue holds the heavy lane and the modules that start daemons (those kept apart from the
            # heavy lane among them), then those that run alone, then the light ones. A worker takes the
            # first module it may start now (`_allowed`); kept from the next module that runs alone, it
            # takes light ones meanwhile. A worker left with nothing it may take waits to be asked again
            # (`mark_test_complete`) while a module kept apart waits for the heavy lane, and is otherwise
            # told to finish and exit: only modules that run alone are left, for the other worker (a
            # worker runs its last test only once it is sent more or told to stop).
            elsewhere = [scope for other, work in self.assigned_work.items() if other is not node
                         for scope, tests in work.items() if not all(tests.values())]
            scope = next((s for s in self.workqueue if self._allowed(s, elsewhere)), None)
            if scope is None:
                if not any(s.startswith(APART) for s in self.workqueue) and not node.shutting_down:
                    node.shutdown()
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def mark_test_complete(self, node: Any, item_index: int | str, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in list(self.assigned_work):  # a worker that waits with nothing to run asks again
                if other is not node and not self._pending_of(self.assigned_work[other]):
                    self._reschedule(other)

        def remove_node(self, node: Any) -> Any:
            crashed = super().remove_node(node)
            for other in list(self.assigned_work):  # a worker kept from a module that runs alone asks again
                self._reschedule(other)
            return crashed

    config.option.loadscopereorder = False  # the order of `order`, not "most tests first"
    return Lanes(config, log)


def order(items: list[pytest.Item], heavy: Collection[str], alone: Collection[str] = (),
          light: Collection[str] = (), apart: Collection[str] = ()) -> None:
    """Sort in place, whole modules at a time (a module's tests stay together and in their order): the
    heavy lane, modules that start daemons (those kept apart first), other modules, those that run
    alone, the light ones."""
    rank: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        mine = (3 if module in alone else 0 if module in heavy else 0.5 if module in apart
                else 4 if is_light(module, light)
                else 1 if item.get_closest_marker("swarm") or item.get_closest_marker("slow") else 2)
        rank[module] = min(mine, rank.get(module, 4))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])

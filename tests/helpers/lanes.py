"""Lanes for the suite's pytest-xdist workers (`-n 2 --dist loadscope`; `make test` runs one process).

    collection (each worker) ─► order(items): heavy modules first, then modules that start daemons, then
                                the rest, the modules that run alone last
    scheduler (the controller) ─► Lanes: one scope per module, one scope for every heavy module together

A module's tests run together on one worker, so a module's shared swarm starts once. The heavy modules
(tests/conftest.py CPU_HEAVY: they keep more than a core busy for a long while) share one scope, so
they run one after another on one worker and never starve each other's timing of CPU, while the other
worker takes the remaining modules, longest kinds first; short unit modules fill the gaps at the end.
The modules that run alone (tests/conftest.py ALONE: they compare the learner's step rate before and
during an attack, which whatever starts on the other worker meanwhile would skew) come last, on one
worker, once the other has finished its work and exited.

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


def make_scheduler(config: pytest.Config, log: Any, heavy: Collection[str], alone: Collection[str] = ()) -> Any:
    """The `pytest_xdist_make_scheduler` of `--dist loadscope`: lanes as scopes, in collection order."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid, heavy, alone)

        def _alone_running(self, elsewhere_than: Any) -> bool:
            return any(scope.startswith(ALONE) and not all(tests.values())
                       for n, work in self.assigned_work.items() if n is not elsewhere_than
                       for scope, tests in work.items())

        def _assign_work_unit(self, node: Any) -> None:
            # Nothing starts beside a module that runs alone. The modules that run alone come last, so once
            # one is next, every other worker with work is told to finish and exit (a worker runs its last
            # test only once it is sent more or told to stop), and the asking one waits until they have;
            # it then runs them all, one after another.
            if self._alone_running(elsewhere_than=node):
                return
            if next(iter(self.workqueue)).startswith(ALONE):
                others = [n for n, work in self.assigned_work.items() if n is not node and self._pending_of(work)]
                for other in others:
                    if not other.shutting_down:
                        other.shutdown()
                if others:
                    return
            super()._assign_work_unit(node)

        def remove_node(self, node: Any) -> Any:
            crashed = super().remove_node(node)
            for other in list(self.assigned_work):  # a worker held back for a module that runs alone asks again
                self._reschedule(other)
            return crashed

    config.option.loadscopereorder = False  # the order of `order`, not "most tests first"
    return Lanes(config, log)


def order(items: list[pytest.Item], heavy: Collection[str], alone: Collection[str] = ()) -> None:
    """Sort in place, whole modules at a time (a module's tests stay together and in their order)."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        mine = (3 if module in alone else 0 if module in heavy
                else 1 if item.get_closest_marker("swarm") or item.get_closest_marker("slow") else 2)
        rank[module] = min(mine, rank.get(module, 3))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])

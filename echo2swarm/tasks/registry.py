"""Task lookup by name: built-ins plus third-party tasks registered as entry points.

A package adds a task by declaring, in its pyproject.toml::

    [project.entry-points."echo2swarm.tasks"]
    my_task = "my_package.tasks:make_task"   # callable(**options) -> Task

and ``get_task("my_task", **options)`` then builds it. Built-in names win over a plugin of the
same name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from echo2swarm.runtime.logging import get_logger
from echo2swarm.tasks.arith import ArithTask
from echo2swarm.tasks.base import Task
from echo2swarm.tasks.math import MathTask
from echo2swarm.tasks.poker import PokerTask

__all__ = ["ENTRY_POINT_GROUP", "available_tasks", "get_task"]

logger = get_logger(__name__)

ENTRY_POINT_GROUP = "echo2swarm.tasks"


_BUILTINS: dict[str, Callable[..., Task]] = {"arith": ArithTask, "math": MathTask, "poker": PokerTask}


def _plugins() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTINS:
            logger.warning("task plugin %s (%s) is shadowed by the built-in task of that name", ep.name, ep.value)
        elif ep.name in found:
            logger.warning("two task plugins named %s (%s, %s); using the first", ep.name, found[ep.name].value, ep.value)
        else:
            found[ep.name] = ep
    return found


def available_tasks() -> list[str]:
    """Names accepted by :func:`get_task`, built-ins and installed plugins, sorted."""
    return sorted({*_BUILTINS, *_plugins()})


def get_task(name: str, **options: object) -> Task:
    """Build the task called ``name`` with ``options`` as keyword arguments.

    Example::

        task = get_task("arith", seed=1)
        task = get_task("math", path="problems.jsonl", eval_fraction=0.05)

    Raises ``ValueError`` for an unknown name (listing the available ones) or options the task
    does not take.
    """
    signature: inspect.Signature | None
    if name in _BUILTINS:
        factory = _BUILTINS[name]
        signature = inspect.signature(factory)
        origin = f"built-in task {name!r}"
    else:
        plugins = _plugins()
        if name not in plugins:
            raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(available_tasks())}")
        ep = plugins[name]
        origin = f"task plugin {name!r} ({ep.value})"
        try:
            factory = ep.load()
        except Exception as exc:
            raise ValueError(f"cannot load {origin}: {exc!r}") from exc
        if not callable(factory):
            raise ValueError(f"{origin} is not callable; it must be a callable(**options) returning a Task")
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):  # some builtins/extension callables have no signature
            signature = None
    if signature is not None:
        try:
            signature.bind(**options)
        except TypeError as exc:
            raise ValueError(f"{origin}: {exc}; it takes {signature}") from None
    task = factory(**options)
    if not isinstance(task, Task):
        raise ValueError(f"{origin} returned {type(task).__name__}, which lacks name/prompt/eval_size/reward")
    return task

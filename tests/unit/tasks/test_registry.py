"""Task registry: built-ins, helpful errors, third-party tasks through entry points."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from echo2swarm.tasks import ArithTask, MathTask, Prompt, registry
from echo2swarm.tasks.math import sample_path
from echo2swarm.tasks.registry import ENTRY_POINT_GROUP, available_tasks, get_task


class EchoTask:
    """A minimal third-party task: the answer is the prompt's index."""

    name = "echo"

    def __init__(self, size: int = 3):
        self.size = size

    def prompt(self, index: int, split: str = "train") -> Prompt:
        return Prompt(f"{split}:{index}", f"say {index}")

    def eval_size(self) -> int:
        return self.size

    def reward(self, prompt_id: str, completion: str, finished: bool) -> float:
        return float(finished and completion == prompt_id.split(":")[1])


def make_echo(**options: object) -> EchoTask:
    return EchoTask(**options)  # type: ignore[arg-type]


class FakeEntryPoint:
    """Stands in for importlib.metadata.EntryPoint: `load()` returns what the plugin exports."""

    def __init__(self, name: str, target: object, value: str = "plugin_pkg:make_task"):
        self.name, self.value, self.group, self._target = name, value, ENTRY_POINT_GROUP, target

    def load(self) -> object:
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def _install(monkeypatch: pytest.MonkeyPatch, *eps: object) -> list[str]:
    groups: list[str] = []

    def fake_entry_points(*, group: str) -> list[object]:
        groups.append(group)
        return list(eps) if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    return groups


def test_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch)
    assert available_tasks() == ["arith", "math", "poker"]
    arith = get_task("arith", seed=5, max_operand=9)
    assert isinstance(arith, ArithTask) and (arith.seed, arith.max_operand) == (5, 9)
    math = get_task("math", path=sample_path(), eval_fraction=0.25)
    assert isinstance(math, MathTask) and math.eval_size() == 5


def test_unknown_name_lists_available(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, FakeEntryPoint("echo", make_echo))
    with pytest.raises(ValueError, match="unknown task 'nope'.*arith, echo, math, poker"):
        get_task("nope")


def test_bad_options_name_the_task_and_its_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    # Options are checked against the factory's signature before it is called; a factory taking
    # **options (make_echo) cannot be checked up front and raises its own TypeError.
    _install(monkeypatch, FakeEntryPoint("echo", EchoTask, value="plugin_pkg:EchoTask"))
    with pytest.raises(ValueError, match="'arith'.*max_operand"):
        get_task("arith", max_operands=9)
    with pytest.raises(ValueError, match="'math'.*path"):
        get_task("math")
    with pytest.raises(ValueError, match="'echo'.*sizee.*size"):
        get_task("echo", sizee=2)


def test_entry_point_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    groups = _install(monkeypatch, FakeEntryPoint("echo", make_echo))
    assert available_tasks() == ["arith", "echo", "math", "poker"]
    task = get_task("echo", size=7)
    assert isinstance(task, EchoTask) and task.eval_size() == 7
    assert task.reward(task.prompt(4).prompt_id, "4", finished=True) == 1.0
    assert set(groups) == {ENTRY_POINT_GROUP}


def test_a_real_entry_point_object_works(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint(name="echo", value=f"{__name__}:make_echo", group=ENTRY_POINT_GROUP)
    _install(monkeypatch, ep)
    assert isinstance(get_task("echo"), EchoTask)


def test_builtins_win_over_plugins_of_the_same_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, FakeEntryPoint("arith", make_echo))
    assert available_tasks() == ["arith", "math", "poker"]
    assert isinstance(get_task("arith"), ArithTask)


def test_broken_plugins_fail_with_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(
        monkeypatch,
        FakeEntryPoint("broken", ImportError("no module named plugin_pkg")),
        FakeEntryPoint("notcallable", 42),
        FakeEntryPoint("nottask", lambda **_: object()),
    )
    with pytest.raises(ValueError, match="cannot load task plugin 'broken'.*plugin_pkg"):
        get_task("broken")
    with pytest.raises(ValueError, match="'notcallable'.*not callable"):
        get_task("notcallable")
    with pytest.raises(ValueError, match="'nottask'.*returned object"):
        get_task("nottask")

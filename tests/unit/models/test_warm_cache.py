"""The warm model cache: one warm-up per recipe, a damaged entry rebuilt, the cache off on request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2swarm.models import warm_cache, warmup
from echo2swarm.models.tiny import write_tiny_model

RECIPE = dict(seed=0, task="arith", warmup_steps=3, hidden_size=32, num_layers=1, num_heads=2)


@pytest.fixture
def warmups(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """The warm-ups that ran, with the cache in tmp_path/cache."""
    monkeypatch.setenv(warm_cache.ENV, str(tmp_path / "cache"))
    ran: list[int] = []
    real = warmup.supervised_warmup

    def counted(*args, **kwargs):
        ran.append(kwargs["steps"])
        return real(*args, **kwargs)

    monkeypatch.setattr(warmup, "supervised_warmup", counted)
    return ran


def test_the_same_recipe_warms_up_once_and_gets_the_same_files(warmups: list[int], tmp_path: Path) -> None:
    first = write_tiny_model(tmp_path / "a", **RECIPE)
    second = write_tiny_model(tmp_path / "b", **RECIPE)
    assert warmups == [3]
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    # Another recipe (seed, steps, task options) is another entry.
    write_tiny_model(tmp_path / "c", **{**RECIPE, "warmup_steps": 4})
    write_tiny_model(tmp_path / "d", **{**RECIPE, "seed": 1})
    assert warmups == [3, 4, 3]
    assert len(list((tmp_path / "cache" / "tiny-models").iterdir())) == 3


def test_a_damaged_entry_is_rebuilt(warmups: list[int], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_tiny_model(tmp_path / "a", **RECIPE)
    (entry,) = (tmp_path / "cache" / "tiny-models").iterdir()
    (entry / "model.safetensors").unlink()
    write_tiny_model(tmp_path / "b", **RECIPE)
    assert warmups == [3, 3] and "damaged warm model cache entry" in caplog.text
    (entry / warm_cache.RECIPE_FILE).write_text(json.dumps({"recipe": {"seed": 7}, "result": {}}))
    write_tiny_model(tmp_path / "c", **RECIPE)
    assert warmups == [3, 3, 3]
    (entry / warm_cache.RECIPE_FILE).write_text("{not json")
    write_tiny_model(tmp_path / "d", **RECIPE)
    assert warmups == [3, 3, 3, 3]
    # ... and rewritten whole each time: the next one reads it
    write_tiny_model(tmp_path / "e", **RECIPE)
    assert warmups == [3, 3, 3, 3]


def test_an_entry_that_is_not_an_object_or_cannot_be_copied_is_a_miss(warmups: list[int], tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_model(tmp_path / "a", **RECIPE)
    (entry,) = (tmp_path / "cache" / "tiny-models").iterdir()
    recipe_text = (entry / warm_cache.RECIPE_FILE).read_text()
    (entry / warm_cache.RECIPE_FILE).write_text("[]")  # JSON, but not an entry
    write_tiny_model(tmp_path / "b", **RECIPE)
    assert warmups == [3, 3]
    # A copy that fails half-way: the files already copied are removed, and the warm-up runs into an empty dir.
    (entry / warm_cache.RECIPE_FILE).write_text(recipe_text)
    real_copy, calls = warm_cache.shutil.copy, []

    def failing_copy(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("read error")
        return real_copy(src, dst)

    monkeypatch.setattr(warm_cache.shutil, "copy", failing_copy)
    out = tmp_path / "c"
    out.mkdir()
    assert warm_cache.lookup(json.loads(recipe_text)["recipe"], out) is None
    assert len(calls) == 2 and list(out.iterdir()) == []


def test_off_and_unwritable_caches_leave_the_model_written(warmups: list[int], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(warm_cache.ENV, "off")
    write_tiny_model(tmp_path / "a", **RECIPE)
    write_tiny_model(tmp_path / "b", **RECIPE)
    assert warmups == [3, 3] and not (tmp_path / "cache").exists()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(warm_cache.ENV, str(tmp_path / "file"))  # a file where the directory should be
    assert (write_tiny_model(tmp_path / "c", **RECIPE) / "config.json").is_file()


def test_where_the_cache_lives(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(warm_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert warm_cache.cache_dir() == tmp_path / "xdg" / "echo2swarm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert warm_cache.cache_dir() == tmp_path / "home" / ".cache" / "echo2swarm"
    monkeypatch.setenv(warm_cache.ENV, " OFF ")
    assert warm_cache.cache_dir() is None

"""Each config field's description is a line or two; the explanation of a knob lives once, in docs/."""

from __future__ import annotations

import importlib
import pkgutil

from pydantic import BaseModel

import echo2swarm.config

MAX_CHARS = 220  # two lines of a --help or TOML comment



def config_models() -> list[type[BaseModel]]:
    models: dict[str, type[BaseModel]] = {}
    for info in pkgutil.iter_modules(echo2swarm.config.__path__):
        module = importlib.import_module(f"echo2swarm.config.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == module.__name__:
                models[obj.__name__] = obj
    return list(models.values())


def test_field_descriptions_are_a_line_or_two() -> None:
    long = {
        f"{model.__name__}.{name}": len(field.description or "")
        for model in config_models()
        for name, field in model.model_fields.items()
        if len(field.description or "") > MAX_CHARS
    }
    assert long == {}, f"over {MAX_CHARS} characters: move the explanation to docs/ and point there"


def test_the_check_sees_every_section() -> None:
    names = {model.__name__ for model in config_models()}
    assert {"TrainConfig", "VerifyConfig", "PublishConfig", "FetchConfig", "MetricsConfig", "LearnerConfig"} <= names

"""Build a role's config from defaults, a TOML file, `ECHO2SWARM_*` variables and CLI flags.

Environment variables name fields with `__` between levels: `ECHO2SWARM_PRICE=0.3`,
`ECHO2SWARM_OVERLAY__RECORD_TTL_S=6`. Values are parsed as JSON when they parse (numbers,
booleans, lists) and taken as strings otherwise.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, overload

from pydantic import TypeAdapter, ValidationError

from echo2swarm.config.flags import FLAG_FOR_FIELD, ROLES
from echo2swarm.config.models import (
    BootstrapConfig, DaemonConfig, LearnerConfig, RelayConfig, RolloutConfig, VerifierConfig,
)

ENV_PREFIX = "ECHO2SWARM_"
# Variables with that prefix that are not config fields: --config's variable, the echo2swarm
# executable scripts/launch_learner.sh runs, and the warm model cache (models/warm_cache.py). Any other
# ECHO2SWARM_* must name a field (typos fail).
_ENV_NOT_FIELDS = {"ECHO2SWARM_CONFIG", "ECHO2SWARM_BIN", "ECHO2SWARM_CACHE_DIR"}

_ADAPTER: TypeAdapter[Any] = TypeAdapter(DaemonConfig)


class ConfigError(ValueError):
    """A config problem, worded for the user: which setting, where it came from, what to change."""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is a value, not a section")
        node = child
    node[leaf] = value


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist (check --config)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in _ENV_NOT_FIELDS:
            continue
        dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        _set_dotted(tree, dotted, value)
    return tree


def _describe(loc: tuple[Any, ...], role: str) -> str:
    # pydantic puts the union tag first ("rollout", "overlay", "price"); users think in dotted fields.
    parts = [str(p) for p in loc]
    if parts and parts[0] == role:
        parts = parts[1:]
    dotted = ".".join(p for p in parts if not p.isdigit())
    if not dotted:  # a whole-config check: its message names the flags itself
        return "configuration"
    where = ".".join(parts)
    hints = [f"[{dotted.rsplit('.', 1)[0]}] in TOML" if "." in dotted else "TOML top level"]
    if dotted in FLAG_FOR_FIELD:
        hints.insert(0, FLAG_FOR_FIELD[dotted])
    hints.append(f"{ENV_PREFIX}{dotted.upper().replace('.', '__')}")
    return f"{where} (set by {', '.join(hints)})"


def format_validation_error(err: ValidationError, role: str) -> str:
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown setting (misspelt? see `echo2swarm daemon --help` and daemon/*.toml)"
        lines.append(f"  {_describe(tuple(e['loc']), role)}: {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


AnyDaemonConfig = LearnerConfig | RolloutConfig | RelayConfig | VerifierConfig | BootstrapConfig


@overload
def load_config(role: Literal["learner"], config_path: Path | None = None, *, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> LearnerConfig: ...
@overload
def load_config(role: Literal["rollout"], config_path: Path | None = None, *, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> RolloutConfig: ...
@overload
def load_config(role: Literal["relay"], config_path: Path | None = None, *, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> RelayConfig: ...
@overload
def load_config(role: Literal["verifier"], config_path: Path | None = None, *, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> VerifierConfig: ...
@overload
def load_config(role: Literal["bootstrap"], config_path: Path | None = None, *, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> BootstrapConfig: ...
@overload
def load_config(role: str | None, config_path: Path | None = None, *, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> AnyDaemonConfig: ...
def load_config(
    role: str | None,
    config_path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> AnyDaemonConfig:
    """Resolve one daemon's config: the role's own model (the `role` field picks it).

    `overrides` maps dotted field names to CLI values (None = not given).
    """
    tree: dict[str, Any] = read_toml(config_path) if config_path else {}
    tree = _deep_merge(tree, env_overrides(os.environ if environ is None else environ))
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, dotted, value)
    if role is not None:
        if tree.get("role") not in (None, role):
            raise ConfigError(f"--role {role} contradicts role = {tree['role']!r} in {config_path}")
        tree["role"] = role
    if tree.get("role") not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)} (pass --role or set role = ... in the TOML)")
    try:
        return _ADAPTER.validate_python(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, tree["role"])) from None


def dump_config(config: AnyDaemonConfig) -> str:
    """The resolved config as JSON, logged at start so a run can be reproduced."""
    return json.dumps(config.model_dump(mode="json"), sort_keys=True)

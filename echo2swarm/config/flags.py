"""Which `echo2swarm daemon` flag sets which config field: the one table the CLI and the errors read.

The CLI turns given flags into dotted overrides with `overrides_from_flags`; config errors name
the flag to change with `FLAG_FOR_FIELD`. A flag that means the same thing on several roles
(`--device`) maps to each role's own field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLES: tuple[str, ...] = ("learner", "rollout", "relay", "verifier", "bootstrap")


@dataclass(frozen=True)
class Flag:
    param: str                       # click's parameter name
    option: str                      # as typed: --upload-limit, --chunk-server/--no-chunk-server
    fields: Mapping[str, str]        # role -> dotted config field the flag sets for that role

    def field_for(self, role: str | None) -> str | None:
        return self.fields.get(role) if role is not None else None


def _flag(param: str, option: str, field: str, roles: tuple[str, ...] = ROLES) -> Flag:
    return Flag(param, option, {role: field for role in roles})


FOLLOWERS = ("rollout", "relay", "verifier")
FLAGS: tuple[Flag, ...] = (
    _flag("price", "--price", "price"),
    _flag("state_dir", "--state-dir", "state_dir"),
    _flag("log_level", "--log-level", "log_level"),
    _flag("upload_limit", "--upload-limit", "upload_limit"),
    _flag("swarm", "--swarm", "overlay.swarm"),
    _flag("initial_peers", "--initial-peers", "overlay.initial_peers"),
    _flag("new_swarm", "--new-swarm", "overlay.new_swarm"),
    _flag("host_maddrs", "--host-maddrs", "overlay.host_maddrs"),
    _flag("announce_maddrs", "--announce-maddrs", "overlay.announce_maddrs"),
    _flag("identity", "--identity", "overlay.identity"),
    _flag("client_mode", "--client-mode", "overlay.client_mode"),
    _flag("use_relay", "--use-relay/--no-use-relay", "overlay.use_relay"),
    _flag("use_auto_relay", "--use-auto-relay/--no-use-auto-relay", "overlay.use_auto_relay"),
    _flag("record_ttl", "--record-ttl", "overlay.record_ttl_s"),
    _flag("announce_period", "--announce-period", "overlay.announce_period_s"),
    _flag("bootstrap_timeout", "--bootstrap-timeout", "overlay.bootstrap_timeout_s"),
    _flag("chunk_server", "--chunk-server/--no-chunk-server", "chunk_server.enabled"),
    _flag("chunk_host", "--chunk-host", "chunk_server.host"),
    _flag("chunk_port", "--chunk-port", "chunk_server.port"),
    _flag("chunk_url", "--chunk-url", "chunk_server.public_url"),
    _flag("trust", "--trust", "trust", FOLLOWERS),
    _flag("peer_assist", "--peer-assist/--no-peer-assist", "fetch.peer_assist", FOLLOWERS),
    _flag("engine", "--engine", "engine.type", ("rollout",)),
    Flag("device", "--device", {"learner": "train.device", "rollout": "engine.device", "verifier": "check.device"}),
    _flag("model", "--model", "publish.model", ("learner",)),
    _flag("policy_key", "--policy-key", "publish.policy_key", ("learner",)),
    _flag("chunk_size", "--chunk-size", "publish.chunk_size", ("learner",)),
)

FLAG_FOR_FIELD: dict[str, str] = {field: f.option for f in FLAGS for field in f.fields.values()}


class FlagError(ValueError):
    """A flag given for a role it does not apply to."""


def overrides_from_flags(values: Mapping[str, Any], role: str | None) -> dict[str, Any]:
    """Dotted field -> value for every flag given (not None). Raises FlagError for a flag of another role.

    `role` is the daemon's role as far as the CLI knows it (--role or the TOML's `role`); with None
    (it may still come from ECHO2SWARM_ROLE), flags every role shares still apply.
    """
    out: dict[str, Any] = {}
    for flag in FLAGS:
        value = values.get(flag.param)
        if value is None:
            continue
        shared = set(flag.fields) == set(ROLES) and len(set(flag.fields.values())) == 1
        field = flag.field_for(role) or (next(iter(flag.fields.values())) if shared else None)
        if field is None:
            raise FlagError(f"{flag.option.split('/')[0]} only applies to --role {'/'.join(flag.fields)}")
        out[field] = value
    return out

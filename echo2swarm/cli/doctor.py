"""`echo2swarm doctor`: check this machine before joining a swarm; each failed check says what to do."""

from __future__ import annotations

import json
from pathlib import Path

import click

from echo2swarm.cli._common import fail, split_addrs
from echo2swarm.config.flags import ROLES

_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "-"}


@click.command(context_settings={"max_content_width": 110})
@click.option("--role", type=click.Choice(ROLES), default=None, help="The role you will run (or `role` in --config). Default: rollout.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), envvar="ECHO2SWARM_CONFIG",
              help="The TOML file you will run the daemon with.")
@click.option("--swarm", help="Swarm name.")
@click.option("--initial-peers", multiple=True, metavar="MADDR", help="The addresses you will join through (repeatable).")
@click.option("--host-maddrs", multiple=True, metavar="MADDR", help="Listen multiaddrs, as for the daemon.")
@click.option("--identity", type=click.Path(dir_okay=False, path_type=Path), help="The identity file, as for the daemon.")
@click.option("--chunk-port", type=int, help="Port of the HTTP chunk server, as for the daemon.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), help="Where versions will be kept.")
@click.option("--engine", help="rollout: engine (auto, transformers, vllm).")
@click.option("--device", help="Device (auto, cpu, cuda, cuda:N).")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait for each peer.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option("--clock-offset", type=float, default=0.0, hidden=True,
              help="Tests only: pretend the local clock is this many seconds ahead.")
def doctor(role, config_path, initial_peers, host_maddrs, timeout, as_json, clock_offset, **flags) -> None:
    """Check that this machine can join a swarm, and say how to fix what cannot work.

    \b
    echo2swarm doctor --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3...
    Checks: the --identity file, ports free, p2pd starts, each --initial-peers address answers, whether
    peers can dial this host (NAT) and its chunk server, clock skew against the swarm, free disk, rollout
    engine and device.
    Exit code 1 when a check fails.
    """
    from echo2swarm.config.flags import FlagError, overrides_from_flags
    from echo2swarm.config.loading import ConfigError, load_config, read_toml

    flags.update(initial_peers=split_addrs(initial_peers), host_maddrs=split_addrs(host_maddrs))
    try:
        effective = role or (read_toml(config_path).get("role") if config_path else None) or "rollout"
        overrides = overrides_from_flags({k: v for k, v in flags.items() if v is not None}, effective)
        if not flags.get("initial_peers"):
            overrides.setdefault("overlay.new_swarm", True)  # nothing to join: still check this machine
        config = load_config(effective if role or not config_path else None, config_path, overrides=overrides)
    except (ConfigError, FlagError) as e:
        fail(str(e))

    import asyncio

    from echo2swarm.daemon.doctor import as_json as checks_json, run_checks
    from echo2swarm.runtime.logging import setup_logging

    setup_logging("ERROR")
    checks = asyncio.run(run_checks(config, timeout, clock_offset))
    if as_json:
        click.echo(json.dumps(checks_json(checks), indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            click.echo(f"{_MARK[c.status]:>4}  {c.name:<{width}}  {c.detail}")
            if c.fix and c.status in ("warn", "fail"):
                click.echo(f"{'':>4}  {'':<{width}}  -> {c.fix}")
    raise SystemExit(1 if any(c.status == "fail" for c in checks) else 0)

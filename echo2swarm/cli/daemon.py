"""`echo2swarm daemon`: run one participant of a swarm."""

from __future__ import annotations

from pathlib import Path

import click

from echo2swarm.cli._common import fail, split_addrs
from echo2swarm.config.flags import ROLES
from echo2swarm.rollout.engines.base import ENGINE_KINDS


@click.command(context_settings={"max_content_width": 110})
@click.option("--role", type=click.Choice(ROLES), help="What this daemon does (or `role` in --config).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), envvar="ECHO2SWARM_CONFIG",
              help="TOML file; flags and ECHO2SWARM_* variables override it. Examples in daemon/.")
@click.option("--swarm", help="Swarm name (namespace of every DHT key). Default: echo2swarm.")
@click.option("--initial-peers", multiple=True, metavar="MADDR",
              help="Multiaddr of a peer in the swarm, /ip4/.../tcp/N/p2p/ID (repeatable).")
@click.option("--new-swarm", is_flag=True, default=None, help="Start a new swarm (no --initial-peers).")
@click.option("--host-maddrs", multiple=True, metavar="MADDR", help="Listen multiaddrs. Default: /ip4/0.0.0.0/tcp/0 and /ip4/0.0.0.0/udp/0/quic-v1 (QUIC: hole punching behind NAT).")
@click.option("--announce-maddrs", multiple=True, metavar="MADDR", help="Public multiaddrs to advertise (explicit ports).")
@click.option("--identity", type=click.Path(dir_okay=False, path_type=Path),
              help="Private key file for a persistent peer id; created if missing.")
@click.option("--client-mode", is_flag=True, default=None, help="Accept no incoming DHT connections (behind NAT).")
@click.option("--use-relay/--no-use-relay", default=None, help="Allow libp2p circuit relays (default on).")
@click.option("--use-auto-relay/--no-use-auto-relay", default=None,
              help="Behind NAT, reserve a circuit relay slot and advertise through it (default on; public peers are unaffected).")
@click.option("--price", type=float, help="Advertised price in USD per hour (>= 0).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keys, pinned trust, chunks, versions. Default: ~/.local/state/echo2swarm.")
@click.option("--trust", metavar="KEY", help="Learner policy key to pin: KEY.pub path or 'ed25519:<hex>'.")
@click.option("--engine", type=click.Choice(ENGINE_KINDS),
              help="rollout: generation engine; auto (default) picks vllm when it imports, else transformers.")
@click.option("--device", metavar="DEVICE",
              help="learner: training device; rollout: transformers engine device. auto (default: cuda when "
              "visible, else cpu), cpu, cuda or cuda:N. vLLM picks its own.")
@click.option("--model", type=click.Path(path_type=Path), help="learner: Hugging Face model directory to publish.")
@click.option("--policy-key", type=click.Path(dir_okay=False, path_type=Path), help="learner: key from `echo2swarm keygen`.")
@click.option("--chunk-size", metavar="SIZE", help="learner: bytes per chunk, e.g. 8MiB.")
@click.option("--upload-limit", metavar="RATE",
              help="Cap this peer's total upload, bytes/s: e.g. 16MiB (or 16MiB/s). Default: unlimited.")
@click.option("--chunk-server/--no-chunk-server", default=None,
              help="Serve chunks over HTTP (default on); off: only over libp2p streams (peers behind NAT).")
@click.option("--peer-assist/--no-peer-assist", default=None,
              help="rollout/relay: fetch versions from other peers too (default on); off: from the learner only.")
@click.option("--chunk-host", help="Interface for the HTTP chunk server. Default: 0.0.0.0.")
@click.option("--chunk-port", type=int, help="Port for the HTTP chunk server. Default: 0 (any free port).")
@click.option("--chunk-url", help="URL peers should use for our chunk server, if not derivable (NAT, proxies).")
@click.option("--record-ttl", type=float, help="Seconds our DHT records live without re-announcement.")
@click.option("--announce-period", type=float, help="Seconds between re-announcements.")
@click.option("--bootstrap-timeout", type=float, help="Seconds to reach --initial-peers before exiting with code 2.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--print-config", is_flag=True, help="Print the resolved config as JSON and exit.")
def daemon(role, config_path, initial_peers, host_maddrs, announce_maddrs, print_config, log_level, **flags) -> None:
    """Run an echo2swarm daemon: learner, rollout peer, relay or bootstrap node.

    \b
    New swarm:   echo2swarm daemon --role bootstrap --new-swarm --host-maddrs /ip4/0.0.0.0/tcp/31337
    Rollout:     echo2swarm daemon --role rollout --price 0.3 --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3...
    Learner:     scripts/launch_learner.sh daemon/learner.toml
    """
    from echo2swarm.config.flags import FlagError, overrides_from_flags
    from echo2swarm.config.loading import ConfigError, dump_config, load_config

    flags.update(initial_peers=split_addrs(initial_peers), host_maddrs=split_addrs(host_maddrs),
                 announce_maddrs=split_addrs(announce_maddrs), log_level=log_level.upper() if log_level else None)
    try:
        effective_role = role
        if effective_role is None and config_path is not None:
            from echo2swarm.config.loading import read_toml

            effective_role = read_toml(config_path).get("role")
        overrides = overrides_from_flags(flags, effective_role)
        config = load_config(role, config_path, overrides=overrides)
    except (ConfigError, FlagError) as e:
        fail(str(e))
    if print_config:
        click.echo(dump_config(config))
        return

    import os

    # Before torch loads: idle OpenMP threads must sleep, not spin, when learner and rollout
    # peers share cores (spinning made generation 4-10x slower on a busy 2-core machine).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from echo2swarm.daemon.supervisor import preflight, run_daemon
    from echo2swarm.runtime.logging import setup_logging

    if config.role == "learner" and int(os.environ.get("RANK", "0")) > 0:
        # Rank 1..W-1 of a sharded learner under torchrun (scripts/launch_learner.sh): no network
        # side, only its shards of the training, following rank 0's commands until it says stop.
        from echo2swarm.train.distributed import serve_rank

        setup_logging(config.log_level)
        os._exit(serve_rank(Path(config.publish.model), config.train, config.verify))  # type: ignore[arg-type]

    try:
        preflight(config)  # bad keys and model directories fail here, before any network start
    except ValueError as e:
        fail(str(e))
    setup_logging(config.log_level)
    code = run_daemon(config)
    # Exit without joining worker threads still busy with work nobody needs any more (see run_daemon).
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""What a daemon tells its operator once it is up: where it is, what it does, how to join it.

    Daemon.run ─► servers bound, role service started ─► start_banner(...) ─► stdout

Only the daemon knows these addresses: ports picked at bind time (port 0), the multiaddrs p2pd
listens on, and the resolved config (TOML, then ECHO2SWARM_* variables, then flags). So it prints
them itself, rather than a launch script guessing from the TOML.
"""

from __future__ import annotations

from collections.abc import Iterable

from echo2swarm.config.loading import AnyDaemonConfig
from echo2swarm.config.models import LearnerConfig, OverlayConfig

DEFAULT_SWARM = OverlayConfig.model_fields["swarm"].default


def start_banner(config: AnyDaemonConfig, peer_id: str, maddrs: list[str], chunk_url: str | None,
                 http_url: str | None, routes: Iterable[str] = ()) -> list[str]:
    """The lines printed at start. `routes`: the extra GET paths the daemon's HTTP server answers."""
    swarm = config.overlay.swarm
    lines = [f"echo2swarm {config.role} {peer_id} is up in swarm '{swarm}'"
             + (f"; chunks at {chunk_url}" if chunk_url else "")]
    if maddrs:
        lines.append("To join this swarm, pass any of these to --initial-peers:")
        lines += [f"  {addr}" for addr in maddrs]
    if isinstance(config, LearnerConfig):
        train = config.train
        options = f" {train.task_options}" if train.task_options else ""
        lines.append(
            f"Training {config.publish.model} on task '{train.task}'{options} for {train.steps} steps: "
            f"staleness S={train.staleness}, a version every {train.publish_every} step(s), "
            f"{train.prompts_per_step} prompts x {train.group_size} completions per step; run dir "
            f"{train.run_dir or config.state_dir / 'run'}"
        )
        swarm_flag = f" --swarm {swarm}" if swarm != DEFAULT_SWARM else ""
        lines += ["A rollout peer joins with (its price in USD/hour, one of the addresses above):",
                  f"  echo2swarm daemon --role rollout --price 0.3{swarm_flag} --initial-peers <address> "
                  f"--trust {config.publish.policy_key}.pub"]
    if http_url:
        if "/" in routes:
            lines.append(f"Live swarm page: {http_url}/")
        lines.append(f"Prometheus metrics: {http_url}/metrics")
    return lines

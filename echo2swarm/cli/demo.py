"""`echo2swarm demo`: a whole swarm on one machine, as separate processes on 127.0.0.1."""

from __future__ import annotations

import time
from pathlib import Path

import click


@click.command()
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where models, keys, state and logs go. Default: runs/demo-<time>.")
@click.option("--rollout-peers", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--swarm", default="demo", show_default=True)
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds allowed for the swarm to sync.")
def demo(run_dir: Path | None, rollout_peers: int, swarm: str, timeout: float) -> None:
    """Start bootstrap + learner + rollout peers locally, publish policy v1, watch it spread, stop cleanly."""
    from echo2swarm.cli.demo_run import run_demo

    run_dir = run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    raise SystemExit(run_demo(run_dir, rollout_peers=rollout_peers, swarm=swarm, timeout=timeout))

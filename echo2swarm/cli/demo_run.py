"""The demo's body (heavy imports allowed here; `cli.demo` imports it only when the demo runs).

    tiny model + policy key ─► bootstrap ─► learner (publishes v1) ─► N rollout peers (--trust key.pub)
                                 watch: a DHT client polls peer cards until every rollout peer holds v1
                                 stop:  SIGTERM to each daemon by pid, timed
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from echo2swarm.runtime.processes import DaemonProcess


def _local_args(swarm: str) -> list[str]:
    # Short periods so a laptop swarm reacts within seconds; public swarms keep the defaults.
    return [
        "--swarm", swarm, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--chunk-host", "127.0.0.1",
        "--announce-period", "1", "--record-ttl", "4", "--log-level", "INFO",
    ]


async def _wait_synced(console: Console, bootstrap: str, swarm: str, rollouts: int, version: int, timeout: float) -> dict:
    from echo2swarm.config.models import OverlayConfig
    from echo2swarm.overlay.census import census
    from echo2swarm.overlay.node import Overlay

    overlay = await Overlay.start(OverlayConfig(swarm=swarm, initial_peers=[bootstrap], host_maddrs=[]), client_mode=True)
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            task = progress.add_task(f"rollout peers holding policy v{version}", total=rollouts)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                view = await census(overlay)
                synced = sum(1 for p in view["peers"] if p["role"] == "rollout" and p["version"] == version)
                progress.update(task, completed=synced)
                if synced >= rollouts and len(view["peers"]) >= rollouts + 2:
                    return view
                if loop.time() > deadline:
                    raise TimeoutError(f"only {synced}/{rollouts} rollout peers reached v{version} in {timeout:.0f} s")
                await asyncio.sleep(0.5)
    finally:
        await overlay.stop()


def run_demo(run_dir: Path, *, rollout_peers: int, swarm: str, timeout: float) -> int:
    from echo2swarm.cli.peers import peers_table
    from echo2swarm.models.tiny import write_tiny_model
    from echo2swarm.policy.signing import PolicyKey
    from echo2swarm.runtime.logging import setup_logging

    setup_logging("WARNING")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    console = Console()
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]echo2swarm demo[/bold] in {run_dir} (logs: {run_dir}/*/daemon.log)")
    model_dir = run_dir / "model"
    if not (model_dir / "config.json").exists():
        write_tiny_model(model_dir, seed=0)
    key_path = run_dir / "learner.key"
    if not key_path.exists():
        PolicyKey.generate().save(key_path)
    console.print(f"  tiny Qwen3-style model at {model_dir}; policy key {key_path}")

    common = _local_args(swarm)
    daemons: list[DaemonProcess] = []
    try:
        with console.status("starting bootstrap node"):
            boot = DaemonProcess("bootstrap", [*common, "--role", "bootstrap", "--new-swarm"], run_dir / "bootstrap")
            daemons.append(boot.start())
            boot.wait_ready(60)
        console.print(f"  bootstrap up: {boot.maddr}", soft_wrap=True)
        join = ["--initial-peers", boot.maddr]
        with console.status("starting learner and publishing policy v1"):
            learner = DaemonProcess(
                "learner",
                [*common, *join, "--role", "learner", "--model", str(model_dir), "--policy-key", str(key_path)],
                run_dir / "learner",
            )
            daemons.append(learner.start())
            learner.wait_ready(120)
        console.print(f"  learner up, serving chunks at {learner.info['chunk_url']}")
        for i in range(rollout_peers):
            peer = DaemonProcess(
                f"rollout-{i + 1}",
                [*common, *join, "--role", "rollout", "--price", f"{0.2 + 0.1 * i:.2f}", "--trust", f"{key_path}.pub"],
                run_dir / f"rollout-{i + 1}",
            )
            daemons.append(peer.start())
        for peer in daemons[2:]:
            peer.wait_ready(120)
        view = asyncio.run(_wait_synced(console, boot.maddr, swarm, rollout_peers, 1, timeout))
        console.print(peers_table(view))
        console.print("[green]every rollout peer verified and installed policy v1[/green]")
        return 0
    except (TimeoutError, RuntimeError) as e:
        console.print(f"[red]demo failed:[/red] {e}")
        for d in daemons:
            console.print(f"--- {d.name} log tail ---\n{d.log_tail(15)}")
        return 1
    finally:
        with console.status("stopping the swarm"):
            timings = [(d.name, d.terminate()) for d in reversed(daemons)]
        console.print("stopped: " + ", ".join(f"{name} in {secs:.1f}s" for name, secs in timings))

"""`echo2swarm simulate`: the swarm at sizes no test machine runs, through the project's own control code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from echo2swarm.cli._common import fail

_COLUMNS = (("peers", "N", "{:,}"), ("design", "design", "{}"), ("card_shard_bits", "bits", "{}"),
            ("plan", "plan", "{}"), ("fanout", "f", "{}"), ("chain_length", "hops", "{}"),
            ("t50_s", "t50 s", "{:.0f}"), ("t90_s", "t90 s", "{:.0f}"), ("t99_s", "t99 s", "{:.0f}"),
            ("learner_copies", "copies", "{:.2f}"), ("busy", "busy", "{:.0%}"),
            ("usd_per_step", "$/step", "{:.3f}"), ("active", "active", "{:,}"), ("planned", "planned", "{:,}"),
            ("control_bytes_per_node_s", "DHT B/s/node", "{:,.0f}"),
            ("control_bytes_busiest_node_s", "busiest B/s", "{:,.0f}"), ("cards_unstored", "unstored", "{:,}"))


def _int_list(ctx: Any, param: Any, value: str) -> list[int]:
    try:
        out = [int(v.replace("_", "")) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give whole numbers separated by commas, e.g. 1000,10000") from None
    if not out or any(not 1 <= n <= 100_000 for n in out):
        raise click.BadParameter(f"{value!r}: each N between 1 and 100,000")
    return out


def _designs(ctx: Any, param: Any, value: str) -> list[str]:
    from echo2swarm.sim.control import DESIGNS

    out = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in out if v not in DESIGNS]
    if not out or bad:
        raise click.BadParameter(f"{value!r}: one or more of {', '.join(DESIGNS)} (comma-separated)")
    return out


@click.command()
@click.option("--peers", "peer_counts", default="1000,10000", show_default=True, callback=_int_list,
              help="Rollout peers N (comma-separated for several swarms).")
@click.option("--design", "designs", default="shards", show_default=True, callback=_designs,
              help="Control plane: shards (card shards, as built) or today (every card under one key, as before "
              "shards); comma-separated for both.")
@click.option("--nat-share", type=click.FloatRange(0, 1), default=0.3, show_default=True, help="Peers behind NAT.")
@click.option("--holepunch-share", type=click.FloatRange(0, 1), default=0.6, show_default=True,
              help="Of those, the share that hole-punches (the rest go through relays).")
@click.option("--churn-per-hour", type=click.FloatRange(0, 10), default=0.2, show_default=True,
              help="Share of the peers leaving per hour.")
@click.option("--params", type=click.FloatRange(1e6, 1e13), default=8e9, show_default=True,
              help="Policy parameters (sets version bytes and the peers' rollouts/s).")
@click.option("--dtype-bytes", type=click.IntRange(1, 4), default=2, show_default=True, help="Bytes a parameter (bf16: 2).")
@click.option("--delta-ratio", type=click.FloatRange(1, 1e6), default=103.5, show_default=True,
              help="Dense over delta bytes of a version (bench_delta at lr 1e-6); 1: dense versions.")
@click.option("--learner-uplink-mbps", type=click.FloatRange(1, 1e6), default=1000.0, show_default=True)
@click.option("--relay-mbps", type=click.FloatRange(0.1, 1e6), default=32.0, show_default=True,
              help="Most a circuit relay carries for one relayed edge.")
@click.option("--rollouts-per-step", type=click.IntRange(1, 10**7), default=512, show_default=True, help="R.")
@click.option("--t-train", "t_train_s", type=click.FloatRange(0.01, 1e5), default=30.0, show_default=True,
              help="Learner seconds of compute per step.")
@click.option("--l-gen", "l_gen_s", type=click.FloatRange(0, 1e5), default=10.0, show_default=True,
              help="Seconds a peer takes to generate one group.")
@click.option("--plan-min-uplink-mbps", type=click.FloatRange(0, 1e6), default=0.0, show_default=True,
              help="What-if, not built: only peers with this uplink or more in the broadcast plan, the others "
              "fetching from holders as leaves. 0: the plan as the learner makes it.")
@click.option("--plan-shape", type=click.Choice(["auto", "chains", "trees"]), default=None,
              help="The broadcast plan's shape (make_plan). Default: the design's (today: chains; shards: auto, "
              "trees from 64 receivers).")
@click.option("--seed", type=int, default=0, show_default=True, help="Draw of the peers (same seed, same swarm).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per swarm (a list when several).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=Path("simulate.png"),
              show_default=True, help="Where the plots go (PNG); skipped with --json.")
def simulate(peer_counts: list[int], designs: list[str], nat_share: float, holepunch_share: float,
             churn_per_hour: float, params: float, dtype_bytes: int, delta_ratio: float, learner_uplink_mbps: float,
             relay_mbps: float, rollouts_per_step: int, t_train_s: float, l_gen_s: float, plan_min_uplink_mbps: float,
             plan_shape: str | None, seed: int, as_json: bool, plot: Path) -> None:
    """Simulate swarms of N rollout peers: time until a version reaches 50/90/99 % of the active peers,
    learner upload in copies, learner busy share, $ a step, and the DHT traffic per node. The links are
    modelled (docs/benchmarks.md, "Simulated swarms"); the shards, broadcast plan, capacity floor and
    activation are the daemons' own code.

    \b
    echo2swarm simulate --peers 1000,10000 --design today,shards
    echo2swarm simulate --peers 10000 --nat-share 0.3 --churn-per-hour 0.2 --params 8e9 --json
    """
    from echo2swarm.sim.run import Scenario, simulate as run

    rows = []
    for n in peer_counts:
        for design in designs:
            if not as_json:
                click.echo(f"simulating {n:,} peers ({design}) ...", err=True)
            try:
                rows.append(run(Scenario(
                    peers=n, design=design, nat_share=nat_share, holepunch_share=holepunch_share,
                    churn_per_hour=churn_per_hour, params=params, dtype_bytes=dtype_bytes, delta_ratio=delta_ratio,
                    learner_uplink_mbps=learner_uplink_mbps, relay_mbps=relay_mbps,
                    rollouts_per_step=rollouts_per_step, t_train_s=t_train_s, l_gen_s=l_gen_s,
                    plan_min_uplink_mbps=plan_min_uplink_mbps, plan_shape=plan_shape, seed=seed)))
            except ValueError as e:
                fail(str(e))
    if as_json:
        click.echo(json.dumps(rows[0] if len(rows) == 1 else rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="simulated swarms", title_justify="left")
    for _, title, _ in _COLUMNS:
        table.add_column(title, justify="right")
    for row in rows:
        table.add_row(*(fmt.format(row[key]) for key, _, fmt in _COLUMNS))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped into a file: the whole table, not columns cut to 80
    console.print(table)
    write_plots(rows, plot)
    click.echo(f"plots: {plot}", err=True)


def write_plots(rows: list[dict[str, Any]], path: Path) -> None:
    """t99 and DHT bytes per node against N, a line per design."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for design in dict.fromkeys(r["design"] for r in rows):
        mine = sorted((r for r in rows if r["design"] == design), key=lambda r: r["peers"])
        n = [r["peers"] for r in mine]
        left.plot(n, [r["t99_s"] for r in mine], marker="o", label=design)
        right.plot(n, [r["control_bytes_per_node_s"] for r in mine], marker="o", label=f"{design}: mean")
        right.plot(n, [r["control_bytes_busiest_node_s"] for r in mine], marker="x", linestyle="--",
                   label=f"{design}: busiest node")
    for ax, title in ((left, "t99: a version to 99 % of active peers (s)"), (right, "DHT bytes/s per node")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rollout peers N")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""`echo2swarm plan`: which rollout peers to activate, from typed numbers or from the live swarm."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import click

from echo2swarm.cli._common import fail, split_addrs
from echo2swarm.control.capacity import DEFAULT_GAMMA, DEFAULT_PUBLISH_EVERY, DEFAULT_STALENESS, staleness_problem

_MU_KEYS = ("rollouts_per_s", "mu")
_ID_KEYS = ("peer_id", "name", "id")


def read_workers(path: Path) -> list[Any]:
    """Peers from a CSV (header: name,price,rollouts_per_s) or a JSON list of objects with those keys."""
    from echo2swarm.control.activation import Worker

    try:
        text = path.read_text()
    except OSError as e:
        fail(f"--workers {path}: cannot read it ({e.strerror})")
    rows: list[dict[str, Any]]
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"--workers {path}: not valid JSON ({e.msg} at line {e.lineno})")
        if isinstance(data, dict) and isinstance(data.get("workers"), list):
            data = data["workers"]
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            fail(f"--workers {path}: expected a JSON list of objects with price and rollouts_per_s")
        rows = data
    elif path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(io.StringIO(text)))
    else:
        fail(f"--workers {path}: use a .csv or .json file")
    if not rows:
        fail(f"--workers {path}: no peers in it")
    workers = []
    for n, row in enumerate(rows, start=1):
        row = {str(k).strip().lower(): v for k, v in row.items() if k is not None}
        where = f"--workers {path}, peer {n}"
        mu_key = next((k for k in _MU_KEYS if k in row), None)
        if mu_key is None or "price" not in row:
            fail(f"{where}: needs columns price (USD/h) and rollouts_per_s (or mu); found {', '.join(row) or 'none'}")
        name = next((str(row[k]).strip() for k in _ID_KEYS if row.get(k) not in (None, "")), f"peer-{n}")
        try:
            price, mu = float(row["price"]), float(row[mu_key])  # type: ignore[arg-type]
        except (TypeError, ValueError):
            fail(f"{where} ({name}): price and {mu_key} must be numbers, got {row['price']!r} and {row[mu_key]!r}")
        try:
            workers.append(Worker(name, mu=mu, price=price))
        except ValueError as e:
            fail(f"{where}: {e}")
    return workers


def _positive(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        fail(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")


def render(report: Any) -> str:
    r = report
    i = r.inputs
    lines = [
        f"plan: R = {i['rollouts_per_step']:g} rollouts/step, T_train = {i['t_train']:.3g} s, "
        f"T_bcast = {i['t_bcast']:.3g} s, L_gen = {i['l_gen']:.3g} s, S = {i['staleness']}, "
        f"kappa = {i['publish_every']}, gamma = {i['gamma']:g} ({r.regime} regime)",
        f"floor: sum(mu) >= {r.floor:.4g} rollouts/s   (gamma * {r.bare_floor:.4g}; "
        f"ECHO-2 sequential mu_min = {r.sequential_mu_min:.4g})",
        f"freshness: T_bcast + L_gen = {i['t_bcast'] + i['l_gen']:.3g} s vs (S - kappa + 1) * T_train = "
        f"{max(0, i['staleness'] - i['publish_every'] + 1) * i['t_train']:.3g} s: {'ok' if r.freshness_ok else 'FAILS'}",
        "",
    ]
    by_id = {w["peer_id"]: w for w in i.get("_workers", [])}
    header = f"  {'peer':<24}{'state':<9}{'price $/h':>10}{'rollouts/s':>12}{'$/1k rollouts':>15}"
    lines.append(header)
    for state, ids in (("active", r.active), ("standby", r.standby)):
        for pid in ids:
            w = by_id.get(pid, {"price": math.nan, "mu": math.nan})
            per_k = w["price"] / (3.6 * w["mu"]) if w["mu"] else math.inf
            lines.append(f"  {pid[-24:]:<24}{state:<9}{w['price']:>10.3f}{w['mu']:>12.2f}{per_k:>15.4f}")
    lines += [
        "",
        f"active: {len(r.active)} of {len(r.active) + len(r.standby)} peers, sum(mu) = {r.active_mu:.4g} rollouts/s "
        f"{'>=' if r.active_mu >= r.floor - 1e-9 else '<'} floor {r.floor:.4g} (all peers: {r.available_mu:.4g})",
        f"predicted: bubble ratio {r.bubble_ratio:.1%}, {r.step_s:.3g} s/step, "
        f"${r.cost_per_step:.5f}/step (${r.price_per_hour:.3f}/h)",
    ]
    if r.feasible:
        lines.append("feasible")
    else:
        lines.append("INFEASIBLE:")
        lines += [f"  - {p}" for p in r.problems]
        lines.append("what would fix it:")
        lines += [f"  - {f}" for f in r.fixes]
    return "\n".join(lines)


@click.command(context_settings={"max_content_width": 110})
@click.option("--rollouts-per-step", type=float, metavar="R", help="R: rollouts per learner step (prompts x group size).")
@click.option("--t-train", type=float, metavar="SECONDS", help="T_train: learner seconds per step.")
@click.option("--t-bcast", type=float, metavar="SECONDS",
              help="T_bcast: seconds until a new version reaches the active peers. Default 0 (live: measured).")
@click.option("--l-gen", type=float, metavar="SECONDS",
              help="L_gen: seconds one lease of groups takes to generate. Default 0 (live: measured).")
@click.option("--staleness", type=int, metavar="S",
              help=f"S: how many versions old a rollout may be. Default {DEFAULT_STALENESS}.")
@click.option("--publish-every", type=int, metavar="KAPPA",
              help=f"kappa: steps between published versions. Default {DEFAULT_PUBLISH_EVERY}.")
@click.option("--gamma", type=float, help=f"Margin over the bare throughput floor. Default {DEFAULT_GAMMA}.")
@click.option("--sequential", is_flag=True,
              help="Peers generate only after a version fully arrived (ECHO-2's form) instead of double-buffering.")
@click.option("--workers", "workers_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Peers as CSV (name,price,rollouts_per_s) or JSON list; price in USD/h.")
@click.option("--initial-peers", multiple=True, metavar="MADDR",
              help="Plan for a live swarm: peers' measured rollouts/s and prices, learner's measured times.")
@click.option("--swarm", default="echo2swarm", show_default=True, envvar="ECHO2SWARM_OVERLAY__SWARM")
@click.option("--timeout", type=float, default=15.0, show_default=True, help="Seconds to reach the live swarm.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(rollouts_per_step, t_train, t_bcast, l_gen, staleness, publish_every, gamma, sequential, workers_path,
         initial_peers, swarm, timeout, as_json) -> None:
    """Pick the cheapest rollout peers that keep the learner busy; print the set, its throughput against
    the floor gamma * R / T_train, the predicted bubble ratio and $/step, or why no set works and which
    S, kappa or broadcast speed would. Exits 3 when no set meets the floor and freshness.

    \b
    echo2swarm plan --rollouts-per-step 1024 --t-train 30 --t-bcast 8 --staleness 1 --workers gpus.csv
    echo2swarm plan --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3... --json
    """
    addrs = split_addrs(initial_peers)
    if addrs and workers_path:
        fail("--workers and --initial-peers exclude each other: plan from a file or from the live swarm")
    if not addrs and not workers_path:
        fail("pass --workers FILE (typed peers) or --initial-peers MADDR (the live swarm)")
    for name, value in (("--rollouts-per-step", rollouts_per_step), ("--t-train", t_train), ("--gamma", gamma)):
        _positive(name, value)
    for name, value in (("--t-bcast", t_bcast), ("--l-gen", l_gen)):
        _positive(name, value, allow_zero=True)
    if staleness is not None and staleness < 0:
        fail(f"--staleness must be >= 0, got {staleness}")
    if publish_every is not None and publish_every < 1:
        fail(f"--publish-every must be >= 1, got {publish_every}")
    typed = {"rollouts_per_step": rollouts_per_step, "t_train": t_train, "t_bcast": t_bcast, "l_gen": l_gen,
             "staleness": staleness, "publish_every": publish_every, "gamma": gamma}
    if addrs:
        from echo2swarm.cli.plan_live import live_inputs

        measured, workers = live_inputs(addrs, swarm, timeout)
        values = {**measured, **{k: v for k, v in typed.items() if v is not None}}
    else:
        workers = read_workers(workers_path)
        values = {k: v for k, v in typed.items() if v is not None}
        missing = [f"--{k.replace('_', '-')}" for k in ("rollouts_per_step", "t_train") if k not in values]
        if missing:
            fail(f"planning from --workers needs {' and '.join(missing)}")
    values.setdefault("t_bcast", 0.0)
    values.setdefault("l_gen", 0.0)
    values.setdefault("staleness", DEFAULT_STALENESS)
    values.setdefault("publish_every", DEFAULT_PUBLISH_EVERY)
    values.setdefault("gamma", DEFAULT_GAMMA)
    from echo2swarm.control.capacity import CapacityInputs
    from echo2swarm.control.planner import make_plan

    problem = staleness_problem(values["staleness"], values["publish_every"])
    if problem is not None:
        fail(f"{problem} (--staleness, --publish-every)")
    try:
        inputs = CapacityInputs(regime="sequential" if sequential else "overlapped", **values)
        report = make_plan(inputs, workers)
    except ValueError as e:
        fail(str(e))
    report.inputs["_workers"] = [{"peer_id": w.peer_id, "price": w.price, "mu": w.mu} for w in workers]
    if as_json:
        out = report.as_dict()
        out["workers"] = out["inputs"].pop("_workers")
        click.echo(json.dumps(out, indent=2, allow_nan=False))
    else:
        click.echo(render(report))
    raise SystemExit(0 if report.feasible else 3)

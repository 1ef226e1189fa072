"""`echo2swarm peers`: join a swarm as a DHT client and show its peers."""

from __future__ import annotations

import json
from typing import Any

import click

from echo2swarm.cli._common import fail, split_addrs


def peers_table(view: dict[str, Any]) -> Any:
    from rich.table import Table

    from echo2swarm.config.units import format_bytes

    heads = ", ".join(f"v{h['version']} by {h['public_key'][8:24]}" for h in view["heads"]) or "none"
    t_bcast = [p["t_bcast_s"] for p in view["peers"] if p.get("t_bcast_s") is not None]
    bcast = f"; T_bcast {t_bcast[0]:.2f}s" if t_bcast else ""
    paged = f" (page {view['page'] + 1} of {view['pages']})" if view.get("pages", 1) > 1 else ""
    table = Table(title=f"swarm '{view['swarm']}': {len(view['peers'])} peers{paged}; policy head {heads}{bcast}",
                  title_justify="left")
    for column, justify in (("peer", "left"), ("role", "left"), ("price $/h", "right"), ("rollouts/s", "right"),
                            ("version", "right"), ("state", "left"), ("activation", "left"), ("arrival", "right"),
                            ("fetch", "left"), ("reach", "left"),
                            ("uplink", "right"), ("last seen", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for p in view["peers"]:
        table.add_row(
            f"…{p['peer_id'][-12:]}", p["role"], f"{p['price']:.3f}",
            "-" if p.get("rollouts_per_s") is None else f"{p['rollouts_per_s']:.1f}",
            "-" if p["version"] is None else str(p["version"]), _state(p), p.get("activation") or "-",
            "-" if p.get("arrival_s") is None else f"{p['arrival_s']:.2f}s",
            "-" if p.get("fetch_path") is None else f"{p['fetch_path']} {format_bytes(p.get('fetch_bytes') or 0)}",
            p.get("reachability") or "-",
            _uplink(p, format_bytes),
            f"{p['last_seen']:.0f}s ago",
        )
    notes = [n for p in view["peers"] for n in p.get("versions") or []]
    if notes:  # the learner's newest versions: keyframes and deltas, with what a delta saves
        table.caption = "versions: " + "; ".join(_version_note(n) for n in notes[-4:])
        table.caption_justify = "left"
    return table


def _uplink(p: dict[str, Any], format_bytes: Any) -> str:
    """Measured upload rate, and the cap the peer set: "1.2 MiB/s", "- (cap 2 MiB/s)", "-"."""
    measured = "-" if p.get("uplink_bps") is None else f"{format_bytes(p['uplink_bps'])}/s"
    return measured if p.get("upload_bps") is None else f"{measured} (cap {format_bytes(p['upload_bps'])}/s)"


def _version_note(n: dict[str, Any]) -> str:
    """`v12 delta 25.2 KiB (dense 592.2 KiB, 23x)` or `v11 dense 592.2 KiB`."""
    from echo2swarm.config.units import format_bytes

    dense, delta = n["dense_bytes"], n.get("delta_bytes")
    if n["kind"] == "delta" and delta is not None:
        return f"v{n['version']} delta {format_bytes(delta)} (dense {format_bytes(dense)}, {dense / max(1, delta):.0f}x)"
    return f"v{n['version']} dense {format_bytes(dense)}"


def _state(peer: dict[str, Any]) -> str:
    if peer.get("banned"):
        return f"BANNED: {peer['banned']}"
    fetching = peer.get("fetching")
    return f"{peer['state']} (fetching v{fetching})" if fetching is not None else peer["state"]


@click.command()
@click.option("--initial-peers", multiple=True, metavar="MADDR", envvar="ECHO2SWARM_OVERLAY__INITIAL_PEERS",
              help="Multiaddr of any peer in the swarm (repeatable).")
@click.option("--swarm", default="echo2swarm", show_default=True, envvar="ECHO2SWARM_OVERLAY__SWARM")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per peer.")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes with --watch.")
@click.option("--timeout", type=float, default=15.0, show_default=True, help="Seconds to reach the swarm.")
@click.option("--page", type=click.IntRange(min=1), default=None, metavar="N",
              help="In a large swarm, page N of its card shards (16 shards, ~2,000 peers a page); the learner is on "
              "page 1. Default: every peer when they fit one page, else page 1.")
def peers(initial_peers, swarm, as_json, watch, interval, timeout, page) -> None:
    """List the peers of a swarm: role, price, rollouts/s, version, state, activation, arrival, fetch path,
    reachability, uplink (measured, and the cap set), last seen; under the table, the learner's newest versions (dense or delta, and their bytes).

    \b
    echo2swarm peers --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3...
    echo2swarm peers --initial-peers ... --json | jq '.[] | select(.role == "rollout")'
    """
    addrs = split_addrs(initial_peers)
    if not addrs:
        fail("pass --initial-peers with the multiaddr of any peer in the swarm (each daemon prints it at start)")
    from pydantic import ValidationError

    from echo2swarm.config.models import OverlayConfig

    try:
        config = OverlayConfig(
            swarm=swarm, initial_peers=addrs, client_mode=True, bootstrap_timeout_s=timeout, host_maddrs=[]
        )
    except ValidationError as e:
        fail(f"--initial-peers/--swarm: {e.errors()[0]['msg'].removeprefix('Value error, ')}")
    import asyncio

    asyncio.run(_peers(config, as_json, watch, interval, None if page is None else page - 1))


def _nothing_read(config: Any, view: dict[str, Any]) -> str:
    """Why `peers` found no card, and what to check (exit non-zero: an empty list would look like an empty swarm)."""
    refused = view.get("malformed_records", 0)
    what = (f"{refused} records were refused as invalid (unsigned, forged or malformed cards; other peers run "
            "an incompatible echo2swarm version?)" if refused else "the DHT returned no card at all")
    return (
        f"no peer card readable in swarm '{config.swarm}': {what}. Check that --swarm matches the daemons' "
        f"--swarm, that they are running (their logs say 'is up'), and that {', '.join(config.initial_peers)} "
        "is reachable from here (address, port, firewall)"
    )


def _page_note(view: dict[str, Any]) -> None:
    """On stderr: which page of a swarm that spans several this is, and how to see the next."""
    if view.get("pages", 1) > 1:
        page = view["page"] + 1
        more = f"; --page {page + 1} for the next" if page < view["pages"] else ""
        click.echo(f"note: page {page} of {view['pages']} of the swarm's {2 ** view['card_shard_bits']} card shards"
                   f"{more}", err=True)


async def _peers(config: Any, as_json: bool, watch: bool, interval: float, page: int | None) -> None:
    import asyncio

    from rich.console import Console
    from rich.live import Live

    from echo2swarm.overlay.census import census
    from echo2swarm.overlay.node import BootstrapError, Overlay

    try:
        overlay = await Overlay.start(config, client_mode=True)
    except BootstrapError as e:
        fail(str(e))
    try:
        if not watch:
            try:
                view = await census(overlay, page)
            except ValueError as e:
                fail(f"--page: {e}")
            if not view["peers"]:
                fail(_nothing_read(config, view))
            _page_note(view)
            if view.get("cards_left_out"):
                click.echo(f"note: {view['cards_left_out']} more peer cards in the DHT not shown (at most "
                           f"{config.max_cards} are read from a card shard; a flood of cards?)", err=True)
            if as_json:
                click.echo(json.dumps(view["peers"], indent=2))
            else:
                Console().print(peers_table(view))
            return
        if as_json:  # one JSON document per line, for piping
            while True:
                click.echo(json.dumps((await census(overlay, page))["peers"]), nl=True)
                await asyncio.sleep(interval)
        with Live(console=Console(), auto_refresh=False) as live:
            while True:
                live.update(peers_table(await census(overlay, page)), refresh=True)
                await asyncio.sleep(interval)
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    finally:
        await overlay.stop()

"""`echo2swarm simulate`: its DHT cost model, the spread of a version under the real plan, the control
traffic per design, and the command (sim/, cli/simulate.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from echo2swarm.cli.main import cli
from echo2swarm.overlay.dht_keys import shard_of
from echo2swarm.policy.broadcast_plan import MAX_PLAN_ENTRIES
from echo2swarm.sim.broadcast import lab_broadcast, spread
from echo2swarm.sim.control import refresh_reads, steady_depth
from echo2swarm.sim.dht import SimDHT
from echo2swarm.sim.population import MBIT, draw_peers, fake_peer_id
from echo2swarm.sim.run import Scenario, simulate


def test_a_key_is_held_by_the_nodes_nearest_it_and_a_get_costs_its_holders_the_value() -> None:
    dht = SimDHT(500, seed=3)
    holders = dht.holders("sim/peers/3/5")
    kid = int.from_bytes(__import__("hashlib").sha1(b"sim/peers/3/5").digest()[:8], "big") >> 1
    nearest = sorted(range(500), key=lambda i: int(dht.ids[i]) ^ kid)[:5]
    assert list(holders) == nearest
    dht.get(np.array([7, 8]), "sim/peers/3/5", 10_000, np.array([1.0, 2.0]))
    assert all(dht.bytes[h] >= 3 * 10_000 for h in holders)  # every holder on the beam answers with the value
    assert dht.bytes[8] > dht.bytes[7] > 0 and dht.spread > 0
    # hivemind's beam search asks every other node of a small swarm, at most 20 and those on the way in a large one
    assert SimDHT(9).finds == 8 and SimDHT(10_000).finds == 20 + 5 * 4 and SimDHT(3).value_replies == 2


def test_followers_sampling_a_sharded_swarm_read_at_a_doubling_wait() -> None:
    assert refresh_reads(0.0, 2.0, 30.0, sampling=True) == 1
    assert refresh_reads(60.0, 2.0, 30.0, sampling=False) == 31  # every 2 s
    assert refresh_reads(60.0, 2.0, 30.0, sampling=True) == 6  # at 0, 2, 6, 14, 30 and 60 s


def test_the_learner_settles_on_a_depth_of_about_128_cards_a_shard() -> None:
    for n, bits in ((100, 0), (1_000, 3), (10_000, 7)):
        ids = [fake_peer_id(i) for i in range(n)]
        assert steady_depth(ids, 720, 10, 30.0) == bits
        assert np.bincount([shard_of(p, bits) for p in ids]).max() < 256


def test_a_version_reaches_every_peer_once_from_the_learner_along_the_real_plan() -> None:
    peers = draw_peers(3000, nat_share=0.3, holepunch_share=0.6, params=8e9, seed=1)
    args = dict(version_bytes=150e6, chunk_bytes=65536, learner_up_bps=1000 * MBIT, seeds=2, relay_bps=4 * MBIT,
                source_wait_s=10, churn_per_hour=0.0)
    chains = spread(peers, **args, shape="chains")
    trees = spread(peers, **args)  # auto: trees past TREE_FROM receivers
    for out in (chains, trees):
        assert set(out.arrival) == {p.peer_id for p in peers} and all(t > 0 for t in out.arrival.values())
        assert out.learner_bytes == 150e6 and out.stripes == 2  # one copy from the learner, whatever the shape
    assert chains.plan.tree is None and chains.planned == chains.chain_length == MAX_PLAN_ENTRIES // 2  # the cap
    assert trees.plan.tree is not None and trees.planned == 3000 and trees.chain_length <= 5
    t99 = {name: sorted(out.arrival.values())[int(0.99 * 3000)] for name, out in (("chains", chains), ("trees", trees))}
    assert t99["trees"] < t99["chains"] / 3, t99


def test_the_lab_model_is_the_benchs_swarm_star_linear_and_pipelined_near_one_copy_time() -> None:
    # bench_broadcast's loopback swarm (scripts/bench_broadcast.py prints this beside each measurement).
    m, b, chunk = 136.2 * 2**20, 16 * 2**20, 2**20
    ideal = m / b
    assert lab_broadcast(1, m, chunk, b, 1e10, 2) == pytest.approx(ideal, rel=0.01)
    for n in (2, 4, 8):
        assert lab_broadcast(n, m, chunk, b, 1e10, 2, star=True) == pytest.approx(n * ideal, rel=0.01)
        pipelined = lab_broadcast(n, m, chunk, b, 1e10, 2)
        # the learner's one copy, then each hop of the chain a chunk behind its parent
        assert ideal < pipelined < ideal + (n + 1) * chunk / (b / 2)
    # Homes that do not punch fetch through a relay capped below their parent's share: slower.
    homes = lab_broadcast(8, m, chunk, b, 1e10, 2, homes=6, punching=0, relay_bps=b / 4)
    assert homes > lab_broadcast(8, m, chunk, b, 1e10, 2, homes=6, punching=6, relay_bps=b / 4)


def test_card_shards_keep_each_nodes_traffic_flat_where_one_key_does_not() -> None:
    small = {d: simulate(Scenario(peers=1_000, design=d)) for d in ("today", "shards")}
    large = {d: simulate(Scenario(peers=6_000, design=d)) for d in ("today", "shards")}
    assert small["shards"]["card_shard_bits"] == 3 and large["shards"]["card_shard_bits"] == 6
    assert large["today"]["card_shard_bits"] == 0 and large["today"]["cards_unstored"] > 1000  # past 3 MiB a key
    assert large["shards"]["cards_unstored"] == 0
    grow = large["shards"]["control_bytes_per_node_s"] / small["shards"]["control_bytes_per_node_s"]
    assert grow < 1.5, grow
    # (most followers are outside the plan, which takes the peers seen working and 32 others, and sample
    # their shards at a doubling wait: under one key each such read is of every card)
    assert large["today"]["control_bytes_per_node_s"] > 3 * large["shards"]["control_bytes_per_node_s"]
    for r in (*small.values(), *large.values()):
        assert 0 < r["busy"] <= 1 and r["t50_s"] <= r["t90_s"] <= r["t99_s"] and r["learner_copies"] == 1.0
        assert math.isfinite(r["usd_per_step"]) and r["active"] >= 1


def test_the_command_prints_json_and_refuses_what_it_cannot_simulate() -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["simulate", "--peers", "300", "--nat-share", "0.5", "--json"])
    assert out.exit_code == 0, out.output
    row = json.loads(out.output)
    for key in ("peers", "t50_s", "t90_s", "t99_s", "learner_copies", "busy", "control_bytes_per_node_s", "design"):
        assert key in row
    assert row["peers"] == 300 and row["design"] == "shards"
    both = json.loads(runner.invoke(cli, ["simulate", "--peers", "50,60", "--design", "today,shards", "--json"]).output)
    assert [(r["peers"], r["design"]) for r in both] == [(50, "today"), (50, "shards"), (60, "today"), (60, "shards")]
    for args, names in ((["--peers", "0"], "--peers"), (["--design", "tree"], "--design"),
                        (["--nat-share", "1.5"], "--nat-share")):
        bad = runner.invoke(cli, ["simulate", *args, "--json"])
        assert bad.exit_code == 2 and names in bad.output

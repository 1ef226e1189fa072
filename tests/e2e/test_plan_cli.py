"""`echo2swarm plan` from typed numbers, as a user runs it: tables, JSON, infeasible plans and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.swarm import run_cli

pytestmark = pytest.mark.timeout(120)

CSV = """name,price,rollouts_per_s
cheap-a,0.20,10
cheap-b,0.22,10
big,2.40,48
spot,1.10,52
"""


@pytest.fixture
def workers_csv(tmp_path: Path) -> Path:
    path = tmp_path / "gpus.csv"
    path.write_text(CSV)
    return path


def test_plan_prints_the_cheapest_set_meeting_the_floor(workers_csv: Path):
    result = run_cli("plan", "--rollouts-per-step", "128", "--t-train", "2", "--t-bcast", "0.5", "--workers",
                     str(workers_csv))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "floor: sum(mu) >= 70.4 rollouts/s" in out and "feasible" in out
    active = {line.split()[0] for line in out.splitlines() if " active " in f" {line} " and line.startswith("  ")}
    assert active == {"cheap-a", "cheap-b", "spot"}
    assert "bubble ratio 0.0%" in out


def test_plan_json_matches_the_model(workers_csv: Path, tmp_path: Path):
    as_json = tmp_path / "gpus.json"
    as_json.write_text(json.dumps([{"peer_id": "a", "price": 0.3, "mu": 20}, {"peer_id": "b", "price": 0.5, "mu": 20}]))
    result = run_cli("plan", "--rollouts-per-step", "64", "--t-train", "1", "--gamma", "1.0", "--workers", str(as_json),
                     "--json")
    assert result.returncode == 3, result.stderr  # 40 rollouts/s < floor 64
    plan = json.loads(result.stdout)
    assert plan["feasible"] is False and plan["floor"] == pytest.approx(64.0)
    assert plan["bubble_ratio"] == pytest.approx(1 - 40 / 64)
    assert plan["needed"]["missing_mu"] == pytest.approx(24.0)
    assert {w["peer_id"] for w in plan["workers"]} == {"a", "b"}


def test_infeasible_freshness_names_staleness_and_bandwidth(workers_csv: Path):
    result = run_cli("plan", "--rollouts-per-step", "64", "--t-train", "1", "--t-bcast", "2.5", "--staleness", "1",
                     "--workers", str(workers_csv))
    assert result.returncode == 3
    assert "INFEASIBLE" in result.stdout and "raise staleness S to >= 3" in result.stdout
    assert "broadcast" in result.stdout


def test_sequential_regime_uses_echo2_form(workers_csv: Path):
    result = run_cli("plan", "--rollouts-per-step", "100", "--t-train", "2", "--t-bcast", "1", "--staleness", "2",
                     "--publish-every", "3", "--gamma", "1", "--sequential", "--workers", str(workers_csv), "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["regime"] == "sequential" and plan["floor"] == pytest.approx(60.0)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--t-train", "1", "--workers", "{csv}"], ["--rollouts-per-step"]),
        (["--rollouts-per-step", "64", "--t-train", "0", "--workers", "{csv}"], ["--t-train", "> 0"]),
        (["--rollouts-per-step", "64", "--t-train", "nan", "--workers", "{csv}"], ["--t-train"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--t-bcast", "-1", "--workers", "{csv}"], ["--t-bcast"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--gamma", "-2", "--workers", "{csv}"], ["--gamma"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--staleness", "-1", "--workers", "{csv}"], ["--staleness"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--publish-every", "3", "--staleness", "1", "--workers",
          "{csv}"], ["--staleness", "--publish-every"]),
        (["--rollouts-per-step", "64", "--t-train", "1"], ["--workers", "--initial-peers"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--workers", "/nonexistent.csv"], ["--workers", "cannot read"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--workers", "{bad_cols}"], ["--workers", "rollouts_per_s"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--workers", "{bad_num}"], ["--workers", "peer 2", "numbers"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--workers", "{neg}"], ["--workers", "price"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--workers", "{txt}"], ["--workers", ".csv or .json"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--workers", "{bad_json}"], ["--workers", "JSON"]),
        (["--rollouts-per-step", "64", "--t-train", "1", "--workers", "{dup}"], ["unique"]),
        (["--workers", "{csv}", "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDNSVj168KNjs6cqwmWsqdg9DGvdYcN1E7seBqHR5mAL2"],
         ["--workers", "--initial-peers"]),
    ],
)
def test_bad_input_names_what_to_change(tmp_path: Path, workers_csv: Path, args: list[str], names: list[str]):
    files = {
        "csv": workers_csv,
        "bad_cols": ("c1.csv", "name,cost,speed\na,1,2\n"),
        "bad_num": ("c2.csv", "name,price,rollouts_per_s\na,0.2,10\nb,cheap,10\n"),
        "neg": ("c3.csv", "name,price,rollouts_per_s\na,-0.2,10\n"),
        "txt": ("c4.txt", "a"),
        "bad_json": ("c5.json", "[{"),
        "dup": ("c6.csv", "name,price,rollouts_per_s\na,0.2,10\na,0.3,10\n"),
    }
    paths = {}
    for key, spec in files.items():
        if isinstance(spec, Path):
            paths[key] = str(spec)
        else:
            (tmp_path / spec[0]).write_text(spec[1])
            paths[key] = str(tmp_path / spec[0])
    result = run_cli("plan", *[a.format(**paths) for a in args])
    assert result.returncode == 2, (result.stdout, result.stderr)
    for name in names:
        assert name in result.stderr, result.stderr


def test_plan_help_is_readable():
    result = run_cli("plan", "--help")
    assert result.returncode == 0
    for flag in ("--rollouts-per-step", "--t-train", "--t-bcast", "--staleness", "--publish-every", "--gamma",
                 "--workers", "--initial-peers", "--json"):
        assert flag in result.stdout

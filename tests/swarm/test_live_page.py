"""The learner's live swarm page in a real browser: headless Chromium against a running swarm.

A learner and two rollout peers (priced differently) train; a stranger's validly signed card
carries HTML in its `software` field. Chromium loads the learner's `/`, lets the page poll the
learner's JSON, and dumps the DOM and a screenshot (kept under tmp_path, and copied to
$TEST_ARTIFACTS when set; .ci/run sets it). The test reads what the page shows: the peer table
lists the rollout peers with their roles and prices, the counters show the run's step and reward,
the curves are drawn, and the stranger's HTML is text, not markup.

Chromium missing: the test skips, unless REQUIRE_CHROMIUM=1 (.ci/run), where it fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from helpers.swarm import LocalSwarm, http_json, http_status, learner_toml, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]
PACED = {"ECHO2SWARM_WORKER__MAX_ROLLOUTS_PER_S": "20", "ECHO2SWARM_ENGINE__THREADS": "1"}
PRICES = {"rollout-cheap": 0.25, "rollout-dear": 0.4}
HOSTILE = "<b id=pwned>hi</b>"  # a card field is at most 32 chars
CHROMIUM_TIMEOUT_S = 90.0
VIRTUAL_TIME_MS = 6000  # page time Chromium runs before dumping: the first poll, then two more


@pytest.fixture
def chromium() -> str:
    """The browser's path; asked for first, so a missing one skips before the swarm's model is built."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        why = "chromium is not installed (Debian: `apt-get install chromium`, or `make system-deps` as root)"
        if os.environ.get("REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"REQUIRE_CHROMIUM=1 but {why}")
        pytest.skip(why)
    return path


def _run_chromium(binary: str, url: str, profile: Path, *mode: str) -> subprocess.CompletedProcess[bytes]:
    """One headless Chromium run with its own profile; on timeout its whole process group is killed by pid."""
    cmd = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
           f"--user-data-dir={profile}", f"--virtual-time-budget={VIRTUAL_TIME_MS}", *mode, url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # its own group: renderer and zygote children die with it
    try:
        out, err = proc.communicate(timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class PageText(HTMLParser):
    """What a reader sees in a dumped DOM: text by element id, the peer table's rows, attributes of tags."""

    VOID = {"meta", "link", "br", "img", "input", "hr", "area", "base", "col", "embed", "source", "track", "wbr"}

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.by_id: dict[str, str] = {}
        self.ids: set[str] = set()
        self.rows: list[list[str]] = []
        self.tags: list[tuple[str, dict[str, str]]] = []
        self._open: list[tuple[str, str | None]] = []
        self._row: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if "id" in a:
            self.ids.add(a["id"])
        if tag in self.VOID:
            return
        self._open.append((tag, a.get("id")))
        if tag == "tr" and any(i == "peers-body" for _, i in self._open):
            self._row = []
        elif tag == "td" and self._row is not None:
            self._row.append("")

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            open_tag, _ = self._open.pop()
            if open_tag == tag:
                break
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        for _, element_id in self._open:
            if element_id:
                self.by_id[element_id] = self.by_id.get(element_id, "") + data
        if self._row is not None and self._row and self._open and self._open[-1][0] == "td":
            self._row[-1] += data


async def _stranger_card(bootstrap: str, swarm: str) -> str:
    """A validly signed card whose `software` is HTML (any peer may write its own card); returns its peer id."""
    from echo2swarm.config.models import OverlayConfig
    from echo2swarm.overlay.node import Overlay
    from echo2swarm.wire.records import PeerCard

    config = OverlayConfig(swarm=swarm, initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    overlay = await Overlay.start(config)
    try:
        # A bootstrap's card: no broadcast plan covers it, so it takes no part in the swarm's work.
        card = PeerCard(peer_id=overlay.peer_id, role="bootstrap", price=0.125, state="ready", software=HOSTILE,
                        updated_ms=int(time.time() * 1000))
        assert await overlay.store_card(card, ttl=600.0), "no DHT node stored the stranger's card"
        return overlay.peer_id
    finally:
        await overlay.stop()


def _all_steps(base: str) -> dict[int, dict[str, Any]]:
    records, after = {}, 0
    while True:
        page = http_json(f"{base}/v1/steps?after={after}&limit=500")
        records.update({r["step"]: r for r in page["steps"]})
        if not page["more"]:
            return records
        after = page["steps"][-1]["step"]


def _artifacts(tmp_path: Path) -> Path:
    out = tmp_path / "artifacts"
    out.mkdir()
    return out


def test_live_page_shows_the_running_swarm_in_a_real_browser(
    chromium: str, local_swarm: LocalSwarm, tiny_model_dir: Path, policy_key: Path, tmp_path: Path
):
    # Steps padded to 0.5 s: a steady run that leaves CPU to the browser. (The tiny model's reward may
    # stay 0; the warm one would cost minutes of warm-up on a busy machine.)
    # Re-plan every 2 s (default 10): the active set, and so the cost per step, is known after a few steps.
    config = learner_toml(tmp_path / "learner.toml", tiny_model_dir, policy_key, steps=100_000, min_step_s=0.5,
                          checkpoint_every=100_000, sections={"activation": {"replan_period_s": 2.0}})
    local_swarm.bootstrap()
    learner = local_swarm.start("learner", "--config", str(config))
    trust = Path(f"{policy_key}.pub")
    rollouts = [local_swarm.rollout(name, price=price, trust=trust, env=PACED) for name, price in PRICES.items()]
    for d in (learner, *rollouts):
        local_swarm.ready(d)
    assert local_swarm.bootstrap_addr is not None
    stranger = asyncio.run(asyncio.wait_for(_stranger_card(local_swarm.bootstrap_addr, local_swarm.swarm), 120))
    base = learner.info["chunk_url"]
    ids = {d.name: d.info["peer_id"] for d in rollouts}

    def learner_sees_everyone() -> bool:
        peers = {p["peer_id"]: p for p in http_json(f"{base}/v1/peers")["peers"]}
        return all(peers.get(i, {}).get("working_here") for i in ids.values()) and stranger in peers
    wait_until(learner_sees_everyone, 120, interval=0.5, what="/v1/peers to list both rollout peers and the stranger")

    def steps_with_a_cost() -> bool:
        records = http_json(f"{base}/v1/steps")["steps"]
        return len(records) >= 3 and any(r.get("cost_usd") for r in records)
    wait_until(steps_with_a_cost, 180, interval=0.5, what="three steps, one with a cost (its active set planned)")

    # The JSON the page reads: validated queries, bounded answers.
    assert len(http_json(f"{base}/v1/steps?after=0&limit=2")["steps"]) == 2
    for query, message in (("after=x", "after must be a step number"), ("after=-1", "after must be a step number"),
                           ("limit=0", "limit must be an integer from 1 to 500"), ("limit=501", "limit must be"),
                           ("after=1&after=2", "after given more than once"), ("evil=1", "unknown query parameter")):
        status, text = http_status(f"{base}/v1/steps?{query}")
        assert (status, message in text) == (400, True), (query, status, text)
    assert http_status(f"{base}/v1/peers?x=1")[0] == 400
    with urllib.request.urlopen(f"{base}/", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/html")
        csp = resp.headers["Content-Security-Policy"]
        assert "script-src 'sha256-" in csp and "connect-src 'self'" in csp and "trusted-types 'none'" in csp

    # The browser: dump the DOM once the page has polled the learner, then a screenshot.
    out = _artifacts(tmp_path)
    steps_before = max(_all_steps(base))
    seen: dict[str, Any] = {}

    def page_rendered() -> bool:
        run = _run_chromium(chromium, f"{base}/", tmp_path / "profile-dom", "--dump-dom")
        seen["dom"], seen["stderr"] = run.stdout.decode(errors="replace"), run.stderr.decode(errors="replace")
        body = dict(next((a for tag, a in PageText(seen["dom"]).tags if tag == "body"), {}))
        return run.returncode == 0 and body.get("data-state") == "live"
    wait_until(page_rendered, 240, interval=1.0, what="Chromium to render the page after a successful poll")
    dom = seen["dom"]
    (out / "live-page.html").write_text(dom)
    shot = _run_chromium(chromium, f"{base}/", tmp_path / "profile-shot", "--window-size=1400,1400",
                         f"--screenshot={out / 'live-page.png'}")
    assert shot.returncode == 0, shot.stderr.decode(errors="replace")[-2000:]
    records = _all_steps(base)
    page = PageText(dom)

    # The peer table: the learner, both rollout peers with their short ids, roles and prices, the stranger.
    rows = {row[0]: row for row in page.rows if row and row[0].startswith("…")}
    for name, peer_id in ids.items():
        row = rows.get("…" + peer_id[-12:])
        assert row is not None, f"{name} not in the peer table: {page.rows}"
        assert row[1] == "rollout" and row[2] == f"{PRICES[name]:.3f}", row
        assert int(row[5]) > 0, f"{name} delivered no group as the page shows it: {row}"
    assert rows["…" + learner.info["peer_id"][-12:]][1] == "learner"
    # The stranger's HTML is shown as text, and no element of it exists.
    stranger_row = rows["…" + stranger[-12:]]
    assert stranger_row[10] == HOSTILE and "pwned" not in page.ids and "&lt;b id=pwned&gt;" in dom

    # The counters show numbers from this run; the curves are drawn from its steps.
    step = int(page.by_id["stat-step"])
    assert steps_before <= step <= max(records), (steps_before, step, max(records))
    assert page.by_id["stat-reward"] == f"{records[step]['reward_mean']:.3f}"
    assert page.by_id["stat-cost"] == f"${records[step]['cost_usd']:.5f}"
    assert page.by_id["stat-bubble"] == f"{records[step]['bubble_ratio_total']:.3f}"
    assert page.by_id["stat-version"].startswith("v")
    polylines = [a for tag, a in page.tags if tag == "polyline"]
    assert any(int(a["data-n"]) >= 3 for a in polylines), polylines
    png = (out / "live-page.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    keep = os.environ.get("TEST_ARTIFACTS")
    if keep:
        shutil.copytree(out, Path(keep) / "live-page", dirs_exist_ok=True)
    table = "\n".join(" | ".join(row) for row in page.rows)
    print(f"live page: {out / 'live-page.png'} (step {step}, reward {page.by_id['stat-reward']})\n{table}")

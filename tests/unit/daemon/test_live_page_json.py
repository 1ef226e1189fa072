"""The live page's JSON helpers: validated queries, bounded and valid answers (the browser test runs the page)."""

from __future__ import annotations

import json
import math
import re

import pytest
from aiohttp import web
from multidict import MultiDict

from echo2swarm.daemon.live_page import (
    STEP_FIELDS,
    STEPS_LIMIT,
    _dumps,
    content_security_policy,
    reach,
    step_view,
    steps_query,
)


@pytest.mark.parametrize("query, expected", [
    ({}, (None, STEPS_LIMIT)),
    ({"after": "0"}, (0, STEPS_LIMIT)),
    ({"after": "12", "limit": "3"}, (12, 3)),
    ({"limit": str(STEPS_LIMIT)}, (None, STEPS_LIMIT)),
])
def test_steps_query_accepts(query, expected):
    assert steps_query(MultiDict(query)) == expected


@pytest.mark.parametrize("pairs, message", [
    ([("after", "-1")], "after must be a step number"),
    ([("after", "01")], "after must be a step number"),
    ([("after", "1e3")], "after must be a step number"),
    ([("after", "9" * 14)], "after must be a step number"),
    ([("limit", "0")], "limit must be an integer from 1 to 500"),
    ([("limit", str(STEPS_LIMIT + 1))], "limit must be"),
    ([("limit", "")], "limit must be"),
    ([("after", "1"), ("after", "2")], "after given more than once"),
    ([("x" * 500, "1")], "unknown query parameter"),
])
def test_steps_query_refuses_with_what_to_change(pairs, message):
    with pytest.raises(web.HTTPBadRequest) as e:
        steps_query(MultiDict(pairs))
    assert message in e.value.text and len(e.value.text) < 200


def test_step_view_keeps_numbers_only_and_never_writes_nan():
    record = {"step": 7, "reward_mean": float("nan"), "loss": math.inf, "t_bcast_s": None, "kl": True,
              "refused": {"stale": 3}, "delivered": {f"peer{i}": i for i in range(1000)}, "staleness": [0, 1, 2, 1],
              "cost_usd": 1.5e-5}
    view = step_view(record)
    assert view == {"step": 7, "reward_mean": None, "loss": None, "t_bcast_s": None, "kl": None, "cost_usd": 1.5e-5,
                    "staleness_mean": 1.0, "staleness_max": 2}
    json.loads(_dumps(view))  # strict JSON: a browser's JSON.parse refuses NaN


def test_a_full_steps_answer_stays_small():
    record = {k: 123456.123456 for k in STEP_FIELDS} | {"staleness": list(range(64)), "step": 10**12}
    body = _dumps({"steps": [step_view(record)] * STEPS_LIMIT, "steps_done": 10**12, "limit": STEPS_LIMIT, "more": True})
    assert len(body) < 300_000


def test_reach_says_what_the_card_advertises():
    assert reach("http://10.0.0.1:4000", ["/ip4/10.0.0.1/tcp/1"]) == "http + libp2p"
    assert reach(None, ["/ip4/1.2.3.4/tcp/1/p2p/12D3A/p2p-circuit"]) == "libp2p relay"
    assert reach(None, []) == "none"


def test_csp_allows_exactly_the_shipped_page_inline_blocks():
    from importlib import resources

    html = resources.files("echo2swarm.daemon").joinpath("static/live.html").read_text()
    csp = content_security_policy(html)
    assert len(re.findall(r"'sha256-[A-Za-z0-9+/=]{44}'", csp)) == 2  # one script, one style
    assert "unsafe-inline" not in csp and "connect-src 'self'" in csp and "trusted-types 'none'" in csp
    # Peer data goes in with textContent: no HTML sink in the page's script.
    script = re.search(r"<script>(.*?)</script>", html, flags=re.S).group(1)
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", script)

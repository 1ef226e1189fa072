"""The learner's live swarm page: GET / and the JSON it reads. (Being built: see issue 22.)"""

from __future__ import annotations

from typing import Any

from echo2swarm.policy.server import Handler


def routes(service: Any) -> list[tuple[str, Handler]]:
    """GET routes the learner's HTTP server adds for the live page; none yet."""
    return []

"""The dial-back probe: "can the swarm reach me?", asked of a public peer (overlay/reachability.py).

    rollout (maybe behind NAT) ── DialbackRequest{ports, chunk_port} ──► bootstrap / learner / relay
                               ◄── DialbackReply{observed, reached, chunk_ok, time_ms} ──
        the responder dials only the caller's own observed IP (as libp2p AutoNAT does), so the
        probe cannot be turned against third parties; `time_ms` lets the caller see its clock skew.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# How others reach a peer: public (direct addresses answer), relayed (only through a libp2p circuit
# relay), private (nobody can dial it yet: no direct address answers and no relay slot), unknown
# (no public peer answered the probe).
Reachability = Literal["public", "relayed", "private", "unknown"]
REACHABILITY: tuple[str, ...] = ("public", "relayed", "private", "unknown")
# Transports on which a peer behind NAT was seen holding direct (hole-punched, DCUtR) connections to other
# NAT'd peers: the card's `holepunch` field. Empty: none seen (a public peer needs none).
HolepunchTransport = Literal["quic", "tcp"]
HOLEPUNCH_TRANSPORTS: tuple[str, ...] = ("quic", "tcp")
MAX_PROBE_PORTS = 4
Port = Annotated[int, Field(ge=1, le=65535)]


class DialbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["dialback"] = "dialback"
    ports: list[Port] = Field(default_factory=list, max_length=MAX_PROBE_PORTS, description="our libp2p TCP ports")
    chunk_port: Port | None = Field(None, description="our HTTP chunk server's port; None: none to check")


class DialbackReply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["dialback_reply"] = "dialback_reply"
    observed: str | None = Field(None, max_length=64, description="the caller's IP as the responder sees it")
    relayed: bool = Field(False, description="the caller reached the responder through a relay")
    reached: list[Port] = Field(default_factory=list, max_length=MAX_PROBE_PORTS, description="ports that answered")
    chunk_ok: bool | None = Field(None, description="the chunk server answered as the caller; None: not checked")
    refused: str | None = Field(None, max_length=120, description="why the probe was not run (rate limit)")
    time_ms: int = Field(ge=0, description="the responder's clock when it answered")

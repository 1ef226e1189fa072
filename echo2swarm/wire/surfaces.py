"""The RPC surfaces, declared once: each call's verb, shape, request type and reply types.

    LEARNER_RPC   served by the learner (its Intake), called by rollout peers
        lease    LeaseRequest ───────────────────────► Lease | LeaseWait
        submit   stream of GroupSubmission ──────────► SubmitResult
    DIALBACK_RPC  served by every daemon, called by the reachability probe
        dialback DialbackRequest ────────────────────► DialbackReply
    VERIFIER_RPC  served by verifier daemons, called by the learner whose head lists them
        check    CheckRequest ───────────────────────► CheckFigures | CheckRefused

Both ends derive from these declarations (overlay/rpc.py): `serve` registers an object's
`rpc_<verb>` methods and refuses to start when one is missing; `RpcStub` gives a caller one method
per verb that sends the declared request and accepts only the declared replies. So a verb or a
reply type is spelt here and nowhere else, and cannot drift between server and client.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel

from echo2swarm.wire.checks import CheckFigures, CheckRefused, CheckRequest
from echo2swarm.wire.reach import DialbackReply, DialbackRequest
from echo2swarm.wire.work import GroupSubmission, Lease, LeaseRequest, LeaseWait, SubmitResult


@dataclass(frozen=True)
class Rpc:
    """One call: `rpc_<verb>`, one request (`stream`: a client stream of them) and one reply.

    With several reply types the receiver tells them apart by their `kind` literal, so each must
    have one, and no two the same.

        LEASE = Rpc("lease", LeaseRequest, (Lease, LeaseWait))
    """

    verb: str
    request: type[BaseModel]
    replies: tuple[type[BaseModel], ...]
    stream: bool = False

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.verb):
            raise ValueError(f"RPC verb {self.verb!r}: lower-case letters, digits and _")
        if not self.replies:
            raise ValueError(f"rpc_{self.verb} declares no reply type")
        if len(self.replies) > 1:
            kinds = [_kind(model) for model in self.replies]
            if None in kinds or len(set(kinds)) != len(kinds):
                raise ValueError(f"rpc_{self.verb}: replies {[m.__name__ for m in self.replies]} need distinct "
                                 f"`kind` literals to be told apart (got {kinds})")

    @property
    def handler(self) -> str:
        """The method a server object answers this call with."""
        return f"rpc_{self.verb}"


@dataclass(frozen=True)
class Surface:
    """The calls one kind of server answers, served and called as a whole (overlay/rpc.py)."""

    name: str
    rpcs: tuple[Rpc, ...]

    def __post_init__(self) -> None:
        verbs = [rpc.verb for rpc in self.rpcs]
        if len(set(verbs)) != len(verbs):
            raise ValueError(f"the {self.name} surface declares a verb twice: {verbs}")

    def __iter__(self) -> Iterator[Rpc]:
        return iter(self.rpcs)

    def __getitem__(self, verb: str) -> Rpc:
        for rpc in self.rpcs:
            if rpc.verb == verb:
                return rpc
        raise KeyError(f"the {self.name} surface has no rpc_{verb} (it has {', '.join(self.verbs)})")

    @property
    def verbs(self) -> tuple[str, ...]:
        return tuple(rpc.verb for rpc in self.rpcs)


def _kind(model: type[BaseModel]) -> object:
    field = model.model_fields.get("kind")
    return None if field is None else field.default


LEARNER_RPC = Surface("learner", (
    Rpc("lease", LeaseRequest, (Lease, LeaseWait)),
    Rpc("submit", GroupSubmission, (SubmitResult,), stream=True),
))
DIALBACK_RPC = Surface("dialback", (
    Rpc("dialback", DialbackRequest, (DialbackReply,)),
))
VERIFIER_RPC = Surface("verifier", (
    Rpc("check", CheckRequest, (CheckFigures, CheckRefused)),
))

"""How a peer-supplied message that fails its schema is described: one line, the first error.

Both the DHT records (`wire.records`) and the RPC messages (`overlay.rpc`) are validated with
pydantic; what is wrong with them goes into logs and refusals, so it is short and names the field.
"""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["schema_error"]


def schema_error(error: ValidationError) -> str:
    """``"field.sub: message"`` of the first error, e.g. ``"expires_ms: Input should be a valid integer"``."""
    first = error.errors()[0]
    where = ".".join(map(str, first["loc"]))
    return f"{where}: {first['msg']}" if where else first["msg"]

"""The one-line description of a peer's message that fails its schema."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from echo2swarm.wire.records import RecordError, parse_card
from echo2swarm.wire.schema import schema_error


class _Inner(BaseModel):
    n: int


class _Outer(BaseModel):
    inner: _Inner


def test_names_the_first_failing_field_by_its_dotted_path() -> None:
    with pytest.raises(ValidationError) as caught:
        _Outer.model_validate({"inner": {"n": "x"}})
    assert schema_error(caught.value) == "inner.n: Input should be a valid integer, unable to parse string as an integer"


def test_a_record_refusal_carries_it() -> None:
    with pytest.raises(RecordError, match=r"^peer card does not match the schema: \w+: "):
        parse_card({"peer_id": 5})

"""Helpers shared by CLI commands (kept import-light)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import click

ROLES = ("learner", "rollout", "relay", "bootstrap")


def split_addrs(values: Iterable[str]) -> list[str] | None:
    """Flags may repeat or hold several addresses separated by spaces/commas (as hivemind prints them)."""
    out = [a for v in values for a in re.split(r"[\s,]+", v) if a]
    return out or None


def fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)

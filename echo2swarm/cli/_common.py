"""Helpers shared by CLI commands (kept import-light)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import click

WARMUP_STEPS = 3000  # a cap: on 2 cores ~45 s; the target below usually stops it within 700-1100
WARMUP_ACCURACY = 0.3  # GRPO learns fastest where groups mix right and wrong answers


def warmup_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--warmup-steps and --warmup-accuracy, the same for every command that builds a warm model."""
    command = click.option(
        "--warmup-accuracy", type=click.FloatRange(0.0, 1.0), default=WARMUP_ACCURACY,
        show_default=True, help="Stop the warm-up once greedy accuracy on train prompts reaches this "
        "(checked every 50 steps); 0 runs every step.",
        callback=lambda _ctx, _param, value: value or None)(command)
    return click.option(
        "--warmup-steps", type=click.IntRange(0), default=WARMUP_STEPS, show_default=True,
        help="At most this many supervised warm-up steps (~15 ms each on 2 cores); 0 skips the warm-up.")(command)


def split_addrs(values: Iterable[str]) -> list[str] | None:
    """Flags may repeat or hold several addresses separated by spaces/commas (as hivemind prints them)."""
    out = [a for v in values for a in re.split(r"[\s,]+", v) if a]
    return out or None


def fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)

"""`[metrics]`: where the learner logs each step's metrics and sample completions (learner/metrics.py).

`run_dir/metrics.jsonl` is always written: it is the source of truth that `echo2swarm demo`, the
live page and the benchmarks read. TensorBoard and Weights & Biases are optional extra sinks; one
that fails logs a warning and is dropped for the rest of the run, and training goes on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Sink = Literal["jsonl", "tensorboard", "wandb"]
# W&B refuses these characters in project names; checked here so the error names the field.
_WANDB_PROJECT = re.compile(r"^[^/\\#?%:]{1,128}$")


class MetricsConfig(BaseModel):
    """Experiment trackers. Example::

        [metrics]
        sinks = ["jsonl", "tensorboard", "wandb"]
        wandb_project = "echo2swarm-arith"
        wandb_mode = "offline"        # later: wandb sync <run_dir>/wandb/offline-run-*
        samples_every = 10
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)

    sinks: list[Sink] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where each step's metrics go: jsonl (run_dir/metrics.jsonl, written whether listed or not: "
        "what the demo, live page and benchmarks read), tensorboard, wandb (the `wandb` extra).",
    )
    tensorboard_dir: Path | None = Field(
        None, description="Directory of the TensorBoard event files. None: <run_dir>/tensorboard.",
    )
    wandb_project: str = Field("echo2swarm", description="W&B project the run is logged to.")
    wandb_entity: str | None = Field(
        None, max_length=128, description="W&B entity (user or team). None: the API key's default entity.",
    )
    wandb_run_name: str | None = Field(
        None, min_length=1, max_length=128, description="W&B run display name. None: W&B picks one.",
    )
    wandb_tags: list[str] = Field(default_factory=list, description="W&B run tags (each 1-64 characters).")
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="online: stream to the W&B server (needs WANDB_API_KEY or `wandb login`); offline: write the "
        "run under wandb_dir only, upload later with `wandb sync`; disabled: W&B calls do nothing.",
    )
    wandb_dir: Path | None = Field(
        None, description="Directory W&B writes its `wandb/` folder into (offline runs, logs). None: <run_dir>.",
    )
    wandb_init_timeout_s: float = Field(
        90.0, gt=0, le=600,
        description="Seconds wandb.init may take (starting W&B's service, reaching the server) before the W&B "
        "sink is given up for this run with a warning.",
    )
    samples_every: int = Field(
        10, ge=0, le=1_000_000,
        description="Steps between logs of sample completions (prompt, completion, reward, version, peer) to "
        "run_dir/samples.jsonl and the configured trackers. 0: never.",
    )
    samples_count: int = Field(
        4, ge=1, le=256, description="Completions logged each time, taken across the step's groups.",
    )

    @field_validator("sinks", "wandb_tags", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        # Env values and flags arrive as text: accept "jsonl,wandb" and "jsonl wandb" as well as lists.
        if isinstance(v, str):
            return [p for p in re.split(r"[\s,]+", v) if p]
        return v

    @field_validator("sinks")
    @classmethod
    def _sinks(cls, v: list[str]) -> list[str]:
        seen: set[str] = set()
        for sink in v:
            if sink in seen:
                raise ValueError(f"'{sink}' is listed twice")
            seen.add(sink)
        # jsonl is always written; listing it in the resolved config keeps the printed config true.
        return v if "jsonl" in seen else ["jsonl", *v]

    @field_validator("wandb_project")
    @classmethod
    def _project(cls, v: str) -> str:
        if not _WANDB_PROJECT.fullmatch(v):
            raise ValueError("W&B project names are 1-128 characters without / \\ # ? % :")
        return v

    @field_validator("wandb_tags")
    @classmethod
    def _tags(cls, v: list[str]) -> list[str]:
        for tag in v:
            if not 1 <= len(tag) <= 64:
                raise ValueError(f"W&B tags are 1-64 characters; {tag!r} is {len(tag)}")
        if len(set(v)) != len(v):
            raise ValueError("a tag is listed twice")
        return v

    @field_validator("tensorboard_dir", "wandb_dir")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

"""Per-step learner metrics: run_dir/metrics.jsonl always, TensorBoard and Weights & Biases when configured.

    Learner._train ─► MetricsLog.write(record, groups)
        ├─► metrics.jsonl          one JSON object per step, flushed per line: the source of truth
        ├─► recent()               the last records in memory, for the live page
        ├─► samples.jsonl          every `samples_every` steps: decoded completions with their rewards
        └─► sinks ([metrics] sinks): TensorBoard event files, a W&B run (scalars + a samples table)

A sink that raises, when it starts or on a write, is logged once, counted in `sink_errors`, and
dropped for the rest of the run: trackers never stop training, and metrics.jsonl keeps every step.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from echo2swarm.config.metrics import MetricsConfig
from echo2swarm.train.group import Group
from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)

SAMPLE_COLUMNS = ("step", "version", "peer", "prompt_id", "prompt", "completion", "reward")


class MetricsLog:
    """Append-only, flushed every line, so `tail -f` and a crashed run both see every finished step.

    The last `keep_recent` records also stay in memory (`recent`), for the live page's curves.

    Example::

        log = MetricsLog(run_dir, MetricsConfig(sinks=["jsonl", "tensorboard"]), decode=trainer.decode)
        log.write({"step": 1, "reward_mean": 0.25, "refused": {"stale": 2}}, groups=groups)
        # TensorBoard gets scalars `reward_mean` and `refused/stale` at step 1
    """

    def __init__(self, run_dir: Path, config: MetricsConfig | None = None, *,
                 decode: Callable[[list[int]], str] | None = None, hparams: dict[str, Any] | None = None,
                 keep_recent: int = 2000):
        self.config = config if config is not None else MetricsConfig()
        self._decode = decode
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep_recent)
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._samples_file: Any = None
        self.sink_errors: collections.Counter[str] = collections.Counter()  # failures per sink name
        self.failed: dict[str, str] = {}  # sink name -> why it was dropped
        self._sinks: list[_Sink] = []
        for name in self.config.sinks:
            if name == "jsonl":
                continue
            try:
                self._sinks.append(self._start_sink(name, hparams))
            except Exception as e:  # a tracker never keeps the learner from training
                self._drop(name, "start", e)

    @property
    def sinks(self) -> list[str]:
        """The sinks being written, jsonl first."""
        return ["jsonl", *(s.name for s in self._sinks)]

    def _start_sink(self, name: str, hparams: dict[str, Any] | None) -> _Sink:
        if name == "tensorboard":
            return TensorBoardSink(self.config.tensorboard_dir or self.run_dir / "tensorboard", hparams)
        if name == "wandb":
            return WandbSink(self.config, self.config.wandb_dir or self.run_dir, hparams)
        raise ValueError(f"unknown metrics sink {name!r}")  # config/metrics.py lists the sinks

    def write(self, record: dict[str, Any], groups: Sequence[Group] | None = None) -> None:
        """Log one step's record; every `samples_every` steps also a few of `groups`' completions."""
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._recent.append(record)
        step = int(record.get("step", 0))
        rows = self._sample_rows(step, groups) if groups else []
        if rows:
            if self._samples_file is None:
                self._samples_file = open(self.samples_path, "a", buffering=1)
            self._samples_file.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)
        if not self._sinks:
            return
        values = scalars(record)
        for sink in list(self._sinks):
            try:
                sink.write(step, values, rows)
            except Exception as e:
                self._sinks.remove(sink)
                self._drop(sink.name, "write", e)
                _close_quietly(sink)

    def _sample_rows(self, step: int, groups: Sequence[Group]) -> list[dict[str, Any]]:
        every = self.config.samples_every
        if every == 0 or step % every != 0 or self._decode is None or "samples" in self.failed:
            return []
        try:
            return sample_rows(step, groups, self.config.samples_count, self._decode)
        except Exception as e:  # a completion that does not decode costs the samples, not the step
            self._drop("samples", "decode", e)
            return []

    def _drop(self, name: str, what: str, error: Exception) -> None:
        self.sink_errors[name] += 1
        self.failed[name] = f"{type(error).__name__}: {error}"
        logger.warning("metrics sink %s failed to %s (%s)%s; it is off for the rest of this run, and %s keeps "
                       "every step", name, what, self.failed[name], _hint(name, error), self.path)

    def recent(self, after_step: int | None = None, limit: int = 500) -> list[dict[str, Any]]:
        """At most `limit` of the records kept in memory, oldest first: the last ones, or, with
        `after_step`, the first ones whose step is greater."""
        if limit <= 0:
            return []
        if after_step is None:
            return list(self._recent)[-limit:]
        return [r for r in self._recent if r.get("step", -1) > after_step][:limit]

    def close(self) -> None:
        """Close the files and finish every sink (a W&B run is marked finished)."""
        self._file.close()
        if self._samples_file is not None:
            self._samples_file.close()
        for sink in self._sinks:
            _close_quietly(sink)
        self._sinks = []


def _hint(name: str, error: Exception) -> str:
    if isinstance(error, ImportError):
        return "; install 'echo2swarm[wandb]'" if name == "wandb" else "; install the `tensorboard` package"
    if name == "wandb" and type(error).__name__ == "UsageError":  # no API key, mostly
        return "; set WANDB_API_KEY or run `wandb login`, or set [metrics] wandb_mode = \"offline\""
    return ""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers as tracker scalars: nested counters as `section/key`, number lists as
    `name/mean` and `name/max`; `step` (the x axis), text, booleans and nulls are left out."""
    out: dict[str, float] = {}

    def walk(name: str, value: Any) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{name}/{key}", sub)
        elif isinstance(value, (list, tuple)):
            numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if numbers:
                out[f"{name}/mean"] = sum(numbers) / len(numbers)
                out[f"{name}/max"] = max(numbers)

    for key, value in record.items():
        if key != "step":
            walk(key, value)
    return out


def sample_rows(step: int, groups: Sequence[Group], count: int,
                decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """`count` completions taken round-robin over the groups (the first of each group, then the
    second, ...), decoded, with their rewards and who generated them with which version."""
    rows: list[dict[str, Any]] = []
    prompts: dict[int, str] = {}
    longest = max((len(g.completions) for g in groups), default=0)
    for j in range(longest):
        for i, group in enumerate(groups):
            if len(rows) == count:
                return rows
            if j >= len(group.completions):
                continue
            if i not in prompts:
                prompts[i] = decode(group.prompt_ids)
            rows.append({"step": step, "version": group.version, "peer": group.peer_id, "prompt_id": group.prompt_id,
                         "prompt": prompts[i], "completion": decode(group.completions[j]),
                         "reward": float(group.rewards[j])})
    return rows


class _Sink(Protocol):
    name: str

    def write(self, step: int, values: dict[str, float], samples: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars per step and the samples as a markdown table (TEXT tab), in TensorBoard event files."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, hparams: dict[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter  # the `tensorboard` package

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(str(self.log_dir))
        if hparams:
            self.writer.add_text("config", "```\n" + json.dumps(hparams, indent=2, sort_keys=True) + "\n```", 0)

    def write(self, step: int, values: dict[str, float], samples: list[dict[str, Any]]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        if samples:
            self.writer.add_text("samples", _markdown_table(samples), step)
        self.writer.flush()  # a step takes seconds; an event on disk at once survives a killed learner

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per learner start: scalars at `step`, the samples as a `wandb.Table` under `samples`."""

    name = "wandb"

    def __init__(self, config: MetricsConfig, directory: Path, hparams: dict[str, Any] | None = None):
        import wandb

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._table = wandb.Table
        self.run = wandb.init(
            project=config.wandb_project, entity=config.wandb_entity, name=config.wandb_run_name,
            tags=list(config.wandb_tags), mode=config.wandb_mode, dir=str(directory), config=hparams or {},
            reinit="create_new",  # each MetricsLog owns its run; never finish or reuse someone else's
            # console="off": the daemon's stdout and stderr stay its own (daemon.log); W&B gets metrics only.
            settings=wandb.Settings(init_timeout=config.wandb_init_timeout_s, console="off"),
        )

    def write(self, step: int, values: dict[str, float], samples: list[dict[str, Any]]) -> None:
        data: dict[str, Any] = dict(values)
        if samples:
            data["samples"] = self._table(columns=list(SAMPLE_COLUMNS),
                                          data=[[row[c] for c in SAMPLE_COLUMNS] for row in samples])
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


def _markdown_table(rows: Iterable[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(row[c]) for c in SAMPLE_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def _close_quietly(sink: _Sink) -> None:
    try:
        sink.close()
    except Exception as e:  # the sink already failed, or is closing on the way out
        logger.debug("closing metrics sink %s: %s", sink.name, e)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete record; safe to call while the learner is still writing (a partial last line is skipped)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records

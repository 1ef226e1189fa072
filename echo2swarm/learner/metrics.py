"""Per-step learner metrics: one JSON object per line in run_dir/metrics.jsonl (and TensorBoard if installed)."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

from echo2swarm.runtime.logging import get_logger

logger = get_logger(__name__)


class MetricsLog:
    """Append-only, flushed every line, so `tail -f` and a crashed run both see every finished step.

    The last `keep_recent` records also stay in memory (`recent`), for the live page's curves.
    """

    def __init__(self, run_dir: Path, keep_recent: int = 2000):
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep_recent)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the optional `tensorboard` package

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._recent.append(record)
        if self._tb is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)

    def recent(self, after_step: int | None = None, limit: int = 500) -> list[dict[str, Any]]:
        """At most `limit` of the records kept in memory, oldest first: the last ones, or, with
        `after_step`, the first ones whose step is greater."""
        if limit <= 0:
            return []
        if after_step is None:
            return list(self._recent)[-limit:]
        return [r for r in self._recent if r.get("step", -1) > after_step][:limit]

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


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

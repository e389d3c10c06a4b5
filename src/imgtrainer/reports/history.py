"""logs/training_history.json: the run's config and environment, and one record per epoch.

Rewritten atomically by the main process right after every checkpoint (so the file and the
newest checkpoint agree, and a run started with --overwrite replaces the earlier run's history
together with its checkpoints). On resume it is rebuilt from the history stored in the
checkpoint, so records after the checkpoint's position are dropped and every epoch appears
exactly once. ``metrics.csv`` beside it holds the same records, one row per epoch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from imgtrainer.files import atomic_write
from imgtrainer.reports.trackers.csv_file import METRICS_CSV, metrics_csv


class HistoryWriter:
    """Keeps the epoch records; writes the file only where ``enabled`` (the main process)."""

    def __init__(
        self,
        path: Path,
        header: dict[str, Any],
        enabled: bool,
        records: list[dict[str, Any]] | None = None,
    ):
        self.path = path
        self.header = header
        self.enabled = enabled
        self.records: list[dict[str, Any]] = list(records or [])

    def append(self, record: dict[str, Any]) -> None:
        """Add an epoch's record; the file is written by ``save``, with the checkpoint."""
        self.records.append(record)

    def save(self) -> None:
        if not self.enabled:
            return
        text = json.dumps({**self.header, "epochs": self.records}, indent=2).encode()
        atomic_write(self.path, lambda f: f.write(text), lambda: len(text))
        table = metrics_csv(self.records).encode()
        atomic_write(self.csv_path, lambda f: f.write(table), lambda: len(table))

    @property
    def csv_path(self) -> Path:
        return self.path.parent / METRICS_CSV


def read_history(path: Path) -> dict[str, Any]:
    """Parse a history file; raises ValueError with a reason if it is not one."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("epochs"), list):
        raise ValueError("no 'epochs' list")
    return data

"""logs/training_history.json: the run's config and environment, and one record per epoch.

Rewritten atomically after every epoch by the main process. On resume it is rebuilt from the
history stored in the checkpoint, so records after the checkpoint's position are dropped and
every epoch appears exactly once.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class HistoryWriter:
    """Keeps the epoch records; writes the file only where ``enabled`` (the main process)."""

    def __init__(self, path: Path, header: dict[str, Any], enabled: bool,
                 records: list[dict[str, Any]] | None = None):
        self.path = path
        self.header = header
        self.enabled = enabled
        self.records: list[dict[str, Any]] = list(records or [])

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.save()

    def save(self) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump({**self.header, "epochs": self.records}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def read_history(path: Path) -> dict[str, Any]:
    """Parse a history file; raises ValueError with a reason if it is not one."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("epochs"), list):
        raise ValueError("no 'epochs' list")
    return data

"""logs/training_history.json: the run's config and environment, one record per epoch, its events.

Rewritten atomically by the main process after every checkpoint (the file and the newest
checkpoint agree) and, from a start's first, after each event (``imgtrainer.events``). A resume
rebuilds the records from the checkpoint, so every epoch appears once, but keeps every event of
the earlier starts: they tell what happened, the dropped epochs' too. ``metrics.csv`` holds the
records, a row each.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from imgtrainer import redact
from imgtrainer.errors import UserError
from imgtrainer.events import EventLog, stamp
from imgtrainer.files import atomic_write
from imgtrainer.reports.trackers.csv_file import METRICS_CSV, metrics_csv


@dataclass(frozen=True)
class EpochRecord:
    """One epoch's line of the history; ``as_dict`` is what the file, the checkpoint and the
    hooks keep (in this key order)."""

    epoch: int  # 1-based
    train_loss: float
    train_acc: float
    # val_loss, val_acc, val_top5, with EMA their ``_ema`` twins; empty when not validated
    val: dict[str, float]
    lr: float
    epoch_seconds: float
    train_images_per_sec: float
    peak_memory_mb: float
    micro_batch: int
    # the share of the epoch's training time this process waited for batches
    data_wait_share: float | None = None
    # each rank's seconds per step, outside the step, and data-wait share (``StragglerWatch``)
    ranks: dict[str, float] = field(default_factory=dict)
    # the data audit's images checked and their largest difference (--audit_data_every)
    audit: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        fields = dict(vars(self))
        val, ranks, audit = fields.pop("val"), fields.pop("ranks"), fields.pop("audit")
        if fields["data_wait_share"] is None:
            del fields["data_wait_share"]
        head = {key: fields.pop(key) for key in ("epoch", "train_loss", "train_acc")}
        return {**head, **val, **fields, **ranks, **audit}

    def line(self, epochs: int) -> str:
        """The epoch's log line (without the best-epoch note)."""
        v = self.val
        validated = (
            f"val_loss {v['val_loss']:.4f}  val_acc {v['val_acc']:.4f}  "
            f"val_top5 {v['val_top5']:.4f}  "
            if "val_acc" in v
            else "(not validated)  "
        )
        ema = (
            f"val_loss_ema {v['val_loss_ema']:.4f}  val_acc_ema {v['val_acc_ema']:.4f}  "
            f"val_top5_ema {v['val_top5_ema']:.4f}  "
            if "val_acc_ema" in v
            else ""
        )
        return (
            f"epoch {self.epoch}/{epochs}  train_loss {self.train_loss:.4f}  "
            f"train_acc {self.train_acc:.4f}  {validated}{ema}lr {self.lr:.2e}  "
            f"{self.train_images_per_sec:.0f} img/s  {self.epoch_seconds:.1f}s"
        )


class Best(Protocol):
    """The best epoch so far (``training.best.BestState``)."""

    metric: str
    value: float | None
    epoch: int | None
    weights: str | None  # "ema" or "raw"


def best_note(best: Best, ema_enabled: bool) -> str:
    """Marks a best epoch on its log line; with EMA, says which weights scored it."""
    metric = "" if best.metric == "val_acc" else f" {best.metric}"
    if not ema_enabled:
        return f"  (best{metric})"
    return f"  (best{metric}: {_weights(best)} weights)"


def best_line(best: Best, ema_enabled: bool = False, none: str = "no best {metric} yet") -> str:
    """The best so far, as "best val_acc 0.9123 (epoch 7)" (with EMA shown: "(EMA weights,
    epoch 7)"), or ``none`` when there is none yet."""
    if best.value is None:
        return none.format(metric=best.metric)
    weights = f"{_weights(best)} weights, " if ema_enabled else ""
    return f"best {best.metric} {best.value:.4f} ({weights}epoch {best.epoch})"


def _weights(best: Best) -> str:
    return "EMA" if best.weights == "ema" else "raw"


class HistoryWriter:
    """Keeps the epoch records, with ``events``; writes the file only where ``enabled`` (the
    main process)."""

    def __init__(
        self,
        path: Path,
        header: dict[str, Any],
        enabled: bool,
        live: Callable[[], dict[str, Any]] | None = None,
        events: EventLog | None = None,
    ):
        self.path = path
        self.header = header
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self.live = live  # head fields that change as the run goes (the best epoch so far)
        self.events = events or EventLog()
        # The records of the newest checkpoint; None until this start's first: a start that
        # fails before it leaves the file as it was, like the checkpoints.
        self.written: list[dict[str, Any]] | None = None
        self._lock, self._pending = threading.Lock(), False

    def append(self, record: EpochRecord | dict[str, Any]) -> dict[str, Any]:
        """Add an epoch's record (kept as its dict, returned); the file is written by ``save``,
        with the checkpoint."""
        if isinstance(record, EpochRecord):
            record = record.as_dict()
        self.records.append(record)
        return record

    def open_events(self, continues: bool) -> None:
        """Once saved, the file is rewritten at each event. A start that ``continues`` the run
        (a resume, a torchrun restart) keeps its earlier starts' events, before its own."""
        if not self.enabled:
            return
        try:
            events = read_history(self.path).get("events") if continues else None
        except (OSError, ValueError):
            events = None
        if isinstance(events, list):
            self.events.items[:0] = [e for e in events if isinstance(e, dict)]
        self.events.listener = self.write_events

    def save(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.written, self._pending = list(self.records), False
            self._write()
        table = metrics_csv(self.records).encode()
        atomic_write(self.path.parent / METRICS_CSV, lambda f: f.write(table), lambda: len(table))
        if self._pending:  # an event came while the file was being written
            self.write_events()

    def write_events(self) -> None:
        """The file again, for a new event: from any thread, or a signal handler that
        interrupted a write (which then writes again once done). A failure is left to the
        next checkpoint's save, which reports it."""
        if self.written is None:
            return
        self._pending = True
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._pending = False
                self._write()
            except (OSError, UserError):
                pass
            finally:
                self._lock.release()

    def _write(self) -> None:
        live = self.live() if self.live else {}
        starts = [e for e in self.events.items if e.get("kind") == "start"]
        if starts:  # how long this start ran, for one that is killed
            starts[-1]["until"] = stamp()
        head = {**self.header, **live, "epochs": self.written, "events": list(self.events.items)}
        text = redact.text(json.dumps(head, indent=2, default=str)).encode()
        atomic_write(self.path, lambda f: f.write(text), lambda: len(text))


def read_history(path: Path) -> dict[str, Any]:
    """Parse a history file; raises ValueError with a reason if it is not one."""
    return checked_history(json.loads(path.read_text()))


# The history's head: each key a reader takes, and the type its value must have when present.
HEAD_TYPES: dict[str, type] = {
    "epochs": list,
    "events": list,
    "best": dict,
    "config": dict,
    "versions": dict,
    "environment": dict,
    "world_size": int,
    "effective_batch_size": int,
    "device": str,
    "class_names": list,
    "train_class_counts": list,
    "command": list,
}
# What every epoch record holds, and what a validated one holds besides.
RECORD_KEYS = ("train_loss", "train_acc", "lr")
VALIDATED_KEYS = ("val_loss", "val_acc", "val_top5")
ITEM_TYPES = {"events": dict, "class_names": str, "train_class_counts": int, "command": str}


def _is(value: Any, kind: type) -> bool:
    """``isinstance``, but True and False are not numbers here; an int is a float."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def checked_history(data: Any) -> dict[str, Any]:
    """``data`` if it has a history's shape (the keys readers take, of their types; epoch
    records of numbers with an int ``epoch``), else ValueError naming what is wrong: a file of
    any other shape is not read as one."""
    if not isinstance(data, dict) or not isinstance(data.get("epochs"), list):
        raise ValueError("no 'epochs' list")
    for key, kind in HEAD_TYPES.items():
        value = data.get(key)
        if value is not None and not _is(value, kind):
            raise ValueError(f"{key!r} is not a {kind.__name__}")
        item = ITEM_TYPES.get(key)
        if item is not None and value and not all(_is(v, item) for v in value):
            raise ValueError(f"{key!r} holds other things than {item.__name__}s")
    for record in data["epochs"]:
        _check_record(record)
    best = data.get("best") or {}
    if not all(best.get(k) is None or _is(best[k], str) for k in ("metric", "weights")):
        raise ValueError("'best' names its metric or weights otherwise than by a string")
    if best.get("epoch") is not None and not _is(best["epoch"], int):
        raise ValueError("'best' epoch is not a number")
    return data


def _check_record(record: Any) -> None:
    if not isinstance(record, dict) or not _is(record.get("epoch"), int):
        raise ValueError("an epoch record without its epoch number")
    needed = RECORD_KEYS + (VALIDATED_KEYS if any(k in record for k in VALIDATED_KEYS) else ())
    missing = [key for key in needed if key not in record]
    if missing:
        raise ValueError(f"epoch {record['epoch']}'s record has no {', '.join(missing)}")
    if not all(value is None or _is(value, float) for value in record.values()):
        raise ValueError(f"epoch {record['epoch']}'s record holds values that are not numbers")

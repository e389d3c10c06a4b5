"""A run's events: what happened, as a kind, plain fields and a time, carried by log records.

A call site logs its sentence for people with ``extra=event(kind, **fields)``; on the main
process ``EventLog`` (a logging handler) keeps each record's event with its sentence, and every
warning and error as one too; ``reports.history.HistoryWriter`` writes them beside the epoch
records. The launcher, which has no history, appends its own to ``LAUNCHER_EVENTS``. Readers use
the kinds and fields (listed in docs/development.md), and show a sentence but never parse it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from imgtrainer import redact

KEY = "event"  # the log record's attribute that carries one
LAUNCHER_EVENTS = "launcher_events.jsonl"  # in the log folder: one JSON object a line
MAX_WARNINGS = 200  # a process's warnings kept: a flood of one repeats nothing new


def event(kind: str, **fields: Any) -> dict[str, dict[str, Any]]:
    """The ``extra`` of a logging call whose record is an event of ``kind`` with ``fields``."""
    return {KEY: {"kind": kind, **fields}}


def stamp(seconds: float | None = None) -> str:
    """A time (now by default) as events keep it: local, with its offset, to the second."""
    when = datetime.now() if seconds is None else datetime.fromtimestamp(seconds)
    return when.astimezone().isoformat(timespec="seconds")


class EventLog(logging.Handler):
    """The events of this process (``items``, oldest first); ``listener``, once set, is called
    after each one, from whichever thread logged it (a signal handler too)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.items: list[dict[str, Any]] = []
        self.listener: Callable[[], None] | None = None
        self.pid = os.getpid()
        self.warnings = 0

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, KEY, None)
        if os.getpid() != self.pid:  # a forked loader worker inherited the handler
            return
        if record.levelno >= logging.WARNING:
            self.warnings += 1
            if self.warnings > MAX_WARNINGS:
                return
            fields = {"kind": "warning", **(fields or {}), "level": record.levelname}
        if fields is not None:
            self.add(**fields, text=record.getMessage(), time=stamp(record.created))

    def add(self, kind: str, **fields: Any) -> None:
        """An event of ``kind``, with no sentence logged for it (``fields`` may give the time)."""
        self.items.append({"kind": kind, "time": fields.pop("time", None) or stamp(), **fields})
        if self.listener is not None:
            self.listener()

    @contextlib.contextmanager
    def kept(self, logger: logging.Logger, enabled: bool) -> Iterator[EventLog]:
        """This log handling ``logger``'s records while the block runs, where ``enabled``."""
        if enabled:
            logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)


def append_event(path: Path, kind: str, **fields: Any) -> None:
    """One event as a line at the end of ``path`` (one write: lines never interleave); a log
    folder that cannot be written loses it, never the run."""
    line = redact.text(json.dumps({"kind": kind, "time": stamp(), **fields}, default=str)) + "\n"
    with contextlib.suppress(OSError), open(path, "a") as f:
        f.write(line)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of a file ``append_event`` wrote; a torn or foreign line is skipped."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        with contextlib.suppress(ValueError):
            item = json.loads(line)
            if isinstance(item, dict) and isinstance(item.get("kind"), str):
                found.append(item)
    return found

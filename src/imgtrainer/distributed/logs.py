"""Logging of a run: one file per rank, the main rank's lines on the console."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from imgtrainer import redact
from imgtrainer.distributed.setup import DistInfo

# The project logger: every module logs to a child of it (``imgtrainer.<module>``), and
# ``logging_for_run`` gives it its handlers, so library loggers (torch, timm) are left alone.
PROJECT_LOGGER = "imgtrainer"


@contextlib.contextmanager
def logging_for_run(log_dir: Path, dist: DistInfo, name: str = "train") -> Iterator[None]:
    """While a tool runs, every rank appends to logs/{name}_rank_{r}.log and only the main
    process prints. Afterwards the project logger is as it was, its files closed: a process
    (a test) that runs several tools gets no handler left over from an earlier one."""
    log_dir.mkdir(parents=True, exist_ok=True)
    project = logging.getLogger(PROJECT_LOGGER)
    saved = list(project.handlers), project.level, project.propagate
    project.handlers.clear()
    project.setLevel(logging.INFO)
    project.propagate = False
    # A file or member name that is not UTF-8 is written escaped, never a logging error.
    path = log_dir / f"{name}_rank_{dist.rank}.log"
    file_handler = logging.FileHandler(path, encoding="utf-8", errors="backslashreplace")
    file_handler.setFormatter(_LevelFormatter("%(asctime)s [rank %(rank)s] %(message)s"))
    file_handler.addFilter(_RankFilter(dist.rank))
    project.addHandler(file_handler)
    if dist.is_main:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(_LevelFormatter("%(message)s"))
        project.addHandler(console)
    try:
        yield
    finally:
        for handler in project.handlers:
            handler.close()
        project.handlers[:] = saved[0]
        project.setLevel(saved[1])
        project.propagate = saved[2]


class _LevelFormatter(logging.Formatter):
    """Warnings and errors say so first ("WARNING: ..."); information is the message alone."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = redact.text(record.message)  # credentials never reach a log
        if record.levelno >= logging.WARNING:
            record.message = f"{record.levelname}: {record.message}"
        return super().formatMessage(record)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def console_is_terminal() -> bool:
    """True when progress bars can redraw in place: stderr is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False

"""What a run's own log says about it: its starts, how it ended, the warnings on the way.

When each start began and ended, its summary line, and the warnings (stragglers, the
--max_time stop, unreadable images, ...) it logged.

Read from the main process's ``train_rank_0.log``, which every start of the same log folder
appends to; the run is the last start that was not a resume, and the resumes after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ \[rank \d+\] (.*)$")
START = "Configuration: "  # the first line of every start (``run.train.write_run_config``)
RERUN = re.compile(r"\(rerun: (.+)\)$")
RESUMED = "Resumed from "
ENDINGS = ("Done: ", "Stopped early", "Stopped at epoch", "Stopped by")
# The lines that describe the data and how the run reads it.
DATA_LINES = (
    "Training data:",
    "Validation data:",
    "Image cache:",
    "Loader:",
    "Memory:",
    "Effective batch:",
    "Training ",
)
MAX_WARNINGS = 60


@dataclass
class Record:
    time: datetime
    text: str  # its first line and any lines that follow it


@dataclass
class Start:
    """One start of the run (fresh, resumed by the user, or restarted by torchrun)."""

    records: list[Record] = field(default_factory=list)

    @property
    def began(self) -> datetime:
        return self.records[0].time

    @property
    def ended(self) -> datetime:
        return self.records[-1].time

    @property
    def resumed(self) -> str | None:
        """Its "Resumed from ..." line, if it continued a checkpoint."""
        return next((r.text for r in self.records if r.text.startswith(RESUMED)), None)


def read_records(path: Path) -> list[Record]:
    """The log's records; a line without a time stamp continues the record before it."""
    records: list[Record] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return records
    for line in lines:
        match = RECORD.match(line)
        if match:
            stamp = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S")
            records.append(Record(stamp, match[2]))
        elif records:
            records[-1].text += "\n" + line
    return records


def run_starts(records: list[Record]) -> list[Start]:
    """The starts of the last run: from its last fresh start on (a new run with --overwrite
    starts a new list)."""
    starts: list[Start] = []
    for record in records:
        if record.text.startswith(START) or not starts:
            starts.append(Start())
        starts[-1].records.append(record)
    fresh = max((i for i, s in enumerate(starts) if s.resumed is None), default=0)
    return starts[fresh:]


@dataclass
class RunLog:
    starts: list[Start]

    @classmethod
    def read(cls, path: Path) -> RunLog:
        return cls(run_starts(read_records(path)))

    def records(self) -> list[Record]:
        return [r for start in self.starts for r in start.records]

    def ending(self) -> str | None:
        """How the run ended, in its own words (its last start's summary line)."""
        if not self.starts:
            return None
        last = self.starts[-1].records
        return next((r.text for r in reversed(last) if r.text.startswith(ENDINGS)), None)

    def rerun_command(self) -> str | None:
        """The command that runs the last start's configuration again, as its first line
        says ("Configuration: <file> (rerun: <command>)")."""
        if not self.starts:
            return None
        match = RERUN.search(self.starts[-1].records[0].text.splitlines()[0])
        return match[1] if match else None

    def data_lines(self) -> list[str]:
        """The last start's lines about its data and how it is read."""
        if not self.starts:
            return []
        return [r.text for r in self.starts[-1].records if r.text.startswith(DATA_LINES)]

    def warnings(self) -> list[str]:
        """Every warning and error of the run, each once, with its time (at most
        ``MAX_WARNINGS``: the first ones)."""
        seen: dict[str, None] = {}
        for record in self.records():
            if record.text.startswith(("WARNING: ", "ERROR: ")):
                seen.setdefault(f"{record.time:%Y-%m-%d %H:%M:%S}  {record.text}", None)
        return list(seen)[:MAX_WARNINGS]

    def wall_seconds(self) -> float | None:
        if not self.starts:
            return None
        return sum((s.ended - s.began).total_seconds() for s in self.starts)


def launcher_lines(path: Path, since: datetime | None) -> tuple[list[str], list[str]]:
    """From the launcher's ``torchrun.log``: the torchrun commands it ran ("=== <time>
    <command>") and its hang watchdog's lines, from ``since`` on."""
    commands, watchdog = [], []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return commands, watchdog
    keep = since is None
    for line in lines:
        if line.startswith("=== "):
            try:
                stamp = datetime.strptime(line[4:23], "%Y-%m-%d %H:%M:%S")
            except ValueError:
                continue
            # A launch a few seconds before the run's first log line is this run's.
            keep = since is None or (since - stamp).total_seconds() < 120
            if keep:
                commands.append(line[4:])
        elif keep and "watchdog:" in line:
            watchdog.append(line)
    return commands, watchdog

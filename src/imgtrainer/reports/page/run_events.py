"""What a run's events say about it: its starts, how it ended, the warnings on the way.

Read from the history's ``events`` and the launcher's ``launcher_events.jsonl``
(``imgtrainer.events``): kinds and fields decide, and a sentence is only shown. A history
without events (an older run's) has none of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from imgtrainer.events import read_events

# The events that describe the data and how the run reads it.
DATA_KINDS = ("data", "image_cache", "loader", "memory", "training", "batch", "data_path")
ENDINGS = ("done", "stop")
MAX_WARNINGS = 60
# A launch this many seconds before the run's first event started it.
LAUNCH_SECONDS = 120


def when(item: dict[str, Any], key: str = "time") -> datetime | None:
    """An event's time (with the local offset when it was written without one)."""
    try:
        return datetime.fromisoformat(item[key]).astimezone()
    except (KeyError, TypeError, ValueError):
        return None


def clock(time: datetime) -> str:
    return f"{time:%Y-%m-%d %H:%M:%S}"


@dataclass
class Start:
    """One start of the run (fresh, resumed by the user, or restarted by torchrun)."""

    events: list[dict[str, Any]]

    @property
    def began(self) -> datetime:
        return when(self.events[0])

    @property
    def ended(self) -> datetime:
        """Its last event, or its last write of the history (``until``) if later."""
        until = [when(e, "until") for e in self.events if e.get("until")]
        return max([when(self.events[-1]), *filter(None, until)])

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("kind") == kind), None)


@dataclass
class RunEvents:
    starts: list[Start]

    @classmethod
    def of(cls, history: dict[str, Any] | None) -> RunEvents:
        events = (history or {}).get("events")
        starts: list[Start] = []
        for item in events if isinstance(events, list) else []:
            if not isinstance(item, dict) or when(item) is None:
                continue
            if item.get("kind") == "start" or not starts:
                starts.append(Start([]))
            starts[-1].events.append(item)
        return cls(starts)

    def ending(self) -> dict[str, Any] | None:
        """How the run ended (its last start's "done" or "stop"), if it has."""
        last = self.starts[-1].events if self.starts else []
        return next((e for e in reversed(last) if e.get("kind") in ENDINGS), None)

    def rerun_command(self) -> str | None:
        """The command that runs the last start's configuration again."""
        start = self.starts[-1].first("start") if self.starts else None
        return (start or {}).get("rerun")

    def data_lines(self) -> list[str]:
        """The last start's sentences about its data and how it is read."""
        last = self.starts[-1].events if self.starts else []
        return [str(e.get("text")) for e in last if e.get("kind") in DATA_KINDS]

    def warnings(self, kind: str | None = None) -> list[str]:
        """Every warning and error of the run (of ``kind``), each once, with its time (at most
        ``MAX_WARNINGS``: the first ones)."""
        seen: dict[str, None] = {}
        for start in self.starts:
            for e in start.events:
                if e.get("level") and kind in (None, e.get("kind")):
                    seen.setdefault(f"{clock(when(e))}  {e['level']}: {e.get('text')}", None)
        return list(seen)[:MAX_WARNINGS]

    def wall_seconds(self) -> float | None:
        if not self.starts:
            return None
        return sum((s.ended - s.began).total_seconds() for s in self.starts)


def launcher_events(path: Path, since: datetime | None) -> tuple[list[str], list[str]]:
    """From the launcher's events: the torchrun commands it ran and its hang watchdog's
    lines, from the launch of this run (``since``: its first event) on."""
    commands, watchdog = [], []
    keep = since is None
    for item in read_events(path):
        time = when(item)
        if time is None:
            continue
        if item["kind"] == "launch":
            keep = since is None or (since - time).total_seconds() < LAUNCH_SECONDS
            if keep:
                commands.append(f"{clock(time)} {item.get('command')}")
        elif keep:
            watchdog.append(f"{clock(time)}  {item.get('text')}")
    return commands, watchdog

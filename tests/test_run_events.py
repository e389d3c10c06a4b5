"""A run's events (``imgtrainer.events``): carried by log records, kept by the main process's
handler, written by the history writer with the records of the newest checkpoint, kept across
a resume; the launcher's own in a file of lines. No training run, no torch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import imgtrainer.events as events_module
from imgtrainer.events import LAUNCHER_EVENTS, EventLog, append_event, event, read_events
from imgtrainer.reports.history import HistoryWriter


def a_logger() -> logging.Logger:
    log = logging.getLogger("imgtrainer.test_run_events")
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def test_a_logged_event_keeps_its_fields_and_sentence_and_every_warning_is_one(monkeypatch):
    log, events = a_logger(), EventLog()
    monkeypatch.setattr(events_module, "MAX_WARNINGS", 3)
    with events.kept(log, enabled=True):
        log.info("Image cache: ram (auto)", extra=event("image_cache", cache="ram"))
        log.info("a line for people only")
        log.warning("straggler: rank 1", extra=event("straggler", rank=1))
        log.error("something failed")
        events.add("stop", reason="signal")
        events.pid = -1  # as in a forked loader worker, which inherits the handler
        log.warning("from a worker")
        events.pid = events_module.os.getpid()
        for n in range(3):
            log.warning(f"flood {n}")  # past MAX_WARNINGS: dropped
    log.info("after the run", extra=event("done"))  # the handler is gone
    kinds = [(e["kind"], e.get("level"), e.get("text")) for e in events.items]
    assert kinds == [
        ("image_cache", None, "Image cache: ram (auto)"),
        ("straggler", "WARNING", "straggler: rank 1"),
        ("warning", "ERROR", "something failed"),
        ("stop", None, None),
        ("warning", "WARNING", "flood 0"),
    ]
    assert events.items[0]["cache"] == "ram" and events.items[1]["rank"] == 1
    assert all(e["time"][:4].isdigit() and "T" in e["time"] for e in events.items)
    disabled = EventLog()
    with disabled.kept(log, enabled=False):
        log.warning("not on the main process")
    assert disabled.items == []


def history(path: Path) -> dict:
    return json.loads(path.read_text())


def test_each_event_is_written_with_the_records_of_the_last_save(tmp_path: Path):
    path, events = tmp_path / "training_history.json", EventLog()
    events.add("start", attempt=0)
    writer = HistoryWriter(path, {"config": {}}, enabled=True, events=events)
    writer.open_events(continues=False)
    assert not path.exists()  # nothing is written until an event or a save
    writer.append({"epoch": 1})
    writer.save()
    writer.append({"epoch": 2})  # its checkpoint not written yet
    events.add("stop", reason="signal")
    written = history(path)
    assert [r["epoch"] for r in written["epochs"]] == [1]
    assert [e["kind"] for e in written["events"]] == ["start", "stop"]
    assert written["events"][0]["until"] >= written["events"][0]["time"]
    disabled = HistoryWriter(tmp_path / "other.json", {}, enabled=False, events=EventLog())
    disabled.open_events(continues=False)
    disabled.events.add("start")
    assert not (tmp_path / "other.json").exists()


def test_a_resume_keeps_the_earlier_starts_events_and_a_new_run_does_not(tmp_path: Path):
    path = tmp_path / "training_history.json"
    first = HistoryWriter(path, {"config": {}}, enabled=True, events=EventLog())
    first.open_events(continues=False)
    first.events.add("start", attempt=0)
    for epoch in (1, 2):
        first.append({"epoch": epoch, "train_loss": 1.0, "train_acc": 0.5, "lr": 0.1})
    first.save()
    first.events.add("warning", level="WARNING", text="dropped epoch's warning")
    before = path.read_bytes()
    # A resume from epoch 1's checkpoint: its own start is logged before its history exists.
    # Until its first save (the checkpoint's records) it leaves the file as it was, as a start
    # that fails there must.
    resumed = HistoryWriter(path, {"config": {}}, enabled=True, events=EventLog())
    resumed.events.add("start", attempt=1)
    resumed.open_events(continues=True)
    resumed.events.add("data", images=48)
    assert path.read_bytes() == before
    resumed.records = [{"epoch": 1, "train_loss": 1.0, "train_acc": 0.5, "lr": 0.1}]
    resumed.save()
    resumed.events.add("resume", epoch=2)
    written = history(path)
    assert [r["epoch"] for r in written["epochs"]] == [1]
    assert [(e["kind"], e.get("attempt")) for e in written["events"]] == [
        ("start", 0),
        ("warning", None),
        ("start", 1),
        ("data", None),
        ("resume", None),
    ]
    fresh = HistoryWriter(path, {"config": {}}, enabled=True, events=EventLog())
    fresh.events.add("start", attempt=0)
    fresh.open_events(continues=False)
    fresh.save()
    assert [e["kind"] for e in history(path)["events"]] == ["start"]


def test_an_event_that_comes_during_a_write_is_written_after_it(tmp_path: Path):
    """As a signal handler's warning does, logged while the main thread writes the file."""
    path, events, calls = tmp_path / "training_history.json", EventLog(), []

    def live() -> dict:
        calls.append(1)
        if len(calls) == 1:
            events.add("warning", level="WARNING", text="Received SIGTERM")
        return {}

    writer = HistoryWriter(path, {"config": {}}, enabled=True, live=live, events=events)
    writer.open_events(continues=False)
    writer.save()
    assert [e["text"] for e in history(path)["events"]] == ["Received SIGTERM"]
    assert len(calls) == 2


def test_the_launchers_events_are_lines_and_a_torn_one_is_skipped(tmp_path: Path):
    path = tmp_path / LAUNCHER_EVENTS
    append_event(path, "launch", command="torchrun --nproc-per-node 2 src/train_ddp.py")
    append_event(path, "hang", text="watchdog: rank 1", rank=1)
    append_event(tmp_path / "no-such-folder" / LAUNCHER_EVENTS, "launch")  # lost, not raised
    with open(path, "a") as f:
        f.write('["not an event"]\n{"kind": "hang", "te')  # a foreign line, a killed write
    found = read_events(path)
    assert [(e["kind"], e.get("rank")) for e in found] == [("launch", None), ("hang", 1)]
    assert found[0]["command"].startswith("torchrun") and "T" in found[1]["time"]
    assert read_events(tmp_path / "none.jsonl") == []

"""The hang watchdog's parts, fast: the heartbeat slots a rank writes and the launcher reads, the
judge that names the stuck process among stale ones, the watchdog acting on a real stopped
process (its stacks, its kill), the launcher's ending after a hang, and the straggler watch."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imgtrainer import heartbeat
from imgtrainer.config import hang_seconds, parse_config
from imgtrainer.errors import UserError
from imgtrainer.events import LAUNCHER_EVENTS, read_events
from imgtrainer.heartbeat import (
    CHECK_PROCESS,
    EVAL_WORKER,
    Beat,
    Phase,
    Slot,
    SlotName,
    read_slot,
)
from imgtrainer.process import EXIT_HUNG
from imgtrainer.run import outcome
from imgtrainer.run.watchdog import HangJudge, Watchdog, WatchPlan, hang_line, read_slots
from imgtrainer.training.stragglers import STRAGGLER_GATHERS, StragglerWatch


def test_hang_timeout_is_a_duration_or_off():
    assert hang_seconds("45s") == 45 and hang_seconds("10m") == 600
    assert hang_seconds("0") is None and hang_seconds("off") is None
    with pytest.raises(UserError, match="--hang_timeout"):
        hang_seconds("soon")
    assert parse_config(["--hang_timeout", "2m"]).hang_timeout == "2m"
    assert hang_seconds(parse_config([]).hang_timeout) == 300  # well below the 30 min timeout


def test_a_slot_is_written_in_memory_and_read_from_its_file(tmp_path, monkeypatch):
    monkeypatch.setenv(heartbeat.HEARTBEAT_DIR_ENV, str(tmp_path))
    slot = heartbeat.open_slot(rank=1, attempt=2)
    try:
        name = SlotName.parse(slot.path.name)
        assert (name.rank, name.attempt, name.worker) == (1, 2, -1)
        heartbeat.mark(Phase.STEP, 5)  # before start: not watched yet, nothing stored
        assert read_slot(slot.path).phase is Phase.NOT_STARTED
        heartbeat.start(7)
        with heartbeat.phase(Phase.COLLECTIVE):
            assert read_slot(slot.path).phase is Phase.COLLECTIVE
        beat = read_slot(slot.path)
        assert (beat.phase, beat.step, beat.beat) == (Phase.DATA, 7, 3)
        heartbeat.tick()
        assert read_slot(slot.path).ticks == 1
        heartbeat.finish()
        assert read_slot(slot.path).phase is Phase.DONE
    finally:
        slot.close()
        heartbeat._slot.clear()
    assert not slot.path.exists()


def test_without_the_launcher_there_is_no_slot(monkeypatch):
    monkeypatch.delenv(heartbeat.HEARTBEAT_DIR_ENV, raising=False)
    assert heartbeat.open_slot(0, 0) is None
    heartbeat.mark(Phase.STEP, 1)  # a no-op


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


RANK0, RANK1 = SlotName(0, 0, -1, 100), SlotName(1, 0, -1, 101)
WORKER = SlotName(1, 0, 0, 201)


def beat(n: int, phase: Phase = Phase.STEP, ticks: int = 0) -> Beat:
    return Beat(n, ticks, 4, phase)


def judge(states: dict[int, str] | None = None, whole_job: bool = True) -> tuple[HangJudge, Clock]:
    clock = Clock()
    states = states or {}
    return HangJudge(3.0, whole_job, clock, lambda pid: states.get(pid, "S")), clock


def test_the_rank_behind_is_named_after_the_timeout_not_before():
    hang, clock = judge()
    assert hang.observe({RANK0: beat(10), RANK1: beat(10)}) is None
    clock.now = 1.0  # rank 0 goes on to the next step's backward and waits there for rank 1
    assert hang.observe({RANK0: beat(12), RANK1: beat(10)}) is None
    clock.now = 3.5  # rank 1: 3.5 s without progress; rank 0: 2.5 s
    verdict = hang.observe({RANK0: beat(12), RANK1: beat(10)})
    assert verdict is not None and verdict.culprit == RANK1 and verdict.seconds == 3.5
    clock.now = 4.5  # both stale now: still the one behind, not the one waiting for it
    assert hang.observe({RANK0: beat(12), RANK1: beat(10)}).culprit == RANK1


def test_ranks_stale_at_the_same_point_name_the_stopped_one():
    hang, clock = judge({101: "T"})
    hang.observe({RANK0: beat(10, Phase.COLLECTIVE), RANK1: beat(10, Phase.COLLECTIVE)})
    clock.now = 3.0
    assert hang.observe({RANK0: beat(10), RANK1: beat(10)}).culprit == RANK1


def test_a_rank_stopped_after_another_went_stale_is_named_once_stale_itself():
    """Rank 1, slowed down, stopped after rank 0 began to wait for it: rank 0 is stale first,
    yet the stopped rank is the one named, after its own timeout."""
    hang, clock = judge({101: "T"})
    hang.observe({RANK0: beat(10, Phase.VALIDATION), RANK1: beat(9)})
    clock.now = 1.0  # rank 1 comes to validation, and stops there
    assert hang.observe({RANK0: beat(10), RANK1: beat(10, Phase.VALIDATION)}) is None
    clock.now = 3.5  # rank 0: 3.5 s without progress; rank 1, stopped: 2.5 s
    assert hang.observe({RANK0: beat(10), RANK1: beat(10)}) is None
    clock.now = 4.0
    verdict = hang.observe({RANK0: beat(10), RANK1: beat(10)})
    assert verdict.culprit == RANK1 and verdict.seconds == 3.0


def test_on_several_nodes_ranks_asleep_at_the_same_point_name_nobody():
    """They may wait for a rank of another node, whose own watchdog names it."""
    hang, clock = judge(whole_job=False)
    hang.observe({RANK0: beat(10, Phase.COLLECTIVE), RANK1: beat(10, Phase.COLLECTIVE)})
    clock.now = 5.0
    assert hang.observe({RANK0: beat(10), RANK1: beat(10)}) is None
    hang, clock = judge(whole_job=False)  # one behind the other: named
    hang.observe({RANK0: beat(12), RANK1: beat(10)})
    clock.now = 5.0
    assert hang.observe({RANK0: beat(12), RANK1: beat(10)}).culprit == RANK1


def test_progress_within_a_phase_and_unwatched_phases_name_nobody():
    hang, clock = judge()
    for second in range(10):  # validation batches tick; a finished rank is not watched
        clock.now = float(second)
        slots = {RANK0: beat(10, Phase.VALIDATION, ticks=second), RANK1: beat(9, Phase.DONE)}
        assert hang.observe(slots) is None
    assert hang.observe({RANK0: beat(1, Phase.NOT_STARTED)}) is None


def test_a_rank_waiting_for_data_names_its_worker_stuck_in_a_read_or_stopped():
    for state in "DT":  # in a read that does not return (a hung network file system), stopped
        hang, clock = judge({201: state})
        slots = {RANK0: beat(10), RANK1: beat(9, Phase.DATA), WORKER: beat(0)}
        hang.observe(slots)
        clock.now = 3.0
        verdict = hang.observe(slots)
        assert verdict.culprit == WORKER and verdict.rank_beat.phase is Phase.DATA
        line = hang_line(verdict, "node7", Path("logs/hang/x.txt"))
        assert "rank 1 (host node7, pid 101)" in line
        assert "after global step 4, phase data wait" in line
        assert line.endswith("; its loader worker 0 (pid 201) is stuck; stacks: logs/hang/x.txt")


# After the first validation a rank has its training loader's workers and its validation
# loader's persistent ones: two slots of each index.
TRAIN0, TRAIN1 = SlotName(1, 0, 0, 201), SlotName(1, 0, 1, 202)
VAL0, VAL1 = SlotName(1, 0, 0, 211, EVAL_WORKER), SlotName(1, 0, 1, 212, EVAL_WORKER)
CHECK0 = SlotName(1, 0, 0, 221, CHECK_PROCESS)


def second_epoch(phase: Phase) -> dict[SlotName, Beat]:
    """Rank 1 behind rank 0 in ``phase``, with both loaders' workers."""
    slots = {RANK0: beat(30), RANK1: beat(28, phase)}
    return slots | {n: beat(0) for n in (TRAIN0, TRAIN1, VAL0, VAL1)}


def test_slot_names_of_every_kind_read_back_from_their_files():
    for name in (RANK1, TRAIN1, VAL0, CHECK0):
        assert SlotName.parse(name.file_name) == name
    assert VAL0.file_name == "rank1.a0.v0.p211.hb" and TRAIN0.file_name == "rank1.a0.w0.p201.hb"
    assert SlotName.parse("rank1.a0.x0.p5.hb") is None
    assert (VAL0.who, CHECK0.part) == (
        "validation loader worker 0 of rank 1",
        "its decode-check process 0",
    )


def test_a_rank_stale_in_its_data_wait_after_a_validation_is_named_among_tied_workers():
    """Every worker asleep (the same suspicion), a training and a validation worker of each
    index: sorting them by (suspicion, index, slot) compared two slots, and the TypeError
    ended the launcher's watchdog thread. The rank that waits is named."""
    hang, clock = judge()
    hang.observe(second_epoch(Phase.DATA))
    clock.now = 3.0
    verdict = hang.observe(second_epoch(Phase.DATA))
    assert verdict.culprit == RANK1 and verdict.rank_beat.phase is Phase.DATA


def test_a_rank_names_the_stopped_worker_of_the_loader_it_waits_for():
    """Both loaders' workers 0 stopped: the data wait names the training loader's, the
    validation the validation loader's; the decode check's end names its process."""
    states = {201: "T", 211: "T", 221: "T"}
    for phase, culprit in [(Phase.DATA, TRAIN0), (Phase.VALIDATION, VAL0)]:
        hang, clock = judge(states)
        hang.observe(second_epoch(phase))
        clock.now = 3.0
        assert hang.observe(second_epoch(phase)).culprit == culprit, phase
    hang, clock = judge(states)
    slots = {RANK0: beat(12, Phase.COLLECTIVE), RANK1: beat(11, Phase.DATA_CHECK), CHECK0: beat(0)}
    hang.observe(slots)
    clock.now = 3.0
    verdict = hang.observe(slots)
    assert verdict.culprit == CHECK0
    line = hang_line(verdict, "node7", Path("logs/hang/x.txt"))
    assert (
        "phase waiting for the images' decode check; its decode-check process 0 (pid 221) is stuck;"
        in line
    )


def test_a_stopped_rank_is_named_in_its_data_wait_even_with_a_busy_worker():
    hang, clock = judge({101: "T", 202: "R"})
    hang.observe(second_epoch(Phase.DATA))
    clock.now = 3.0
    assert hang.observe(second_epoch(Phase.DATA)).culprit == RANK1


def test_workers_stuck_alike_name_one_without_comparing_slots():
    """A training and a validation worker 0 in the same state: the training loader's, waited
    for in a data wait, and of it the lowest index (slots have no order of their own)."""
    hang, clock = judge({201: "D", 202: "D", 211: "D"})
    hang.observe(second_epoch(Phase.DATA))
    clock.now = 3.0
    assert hang.observe(second_epoch(Phase.DATA)).culprit == TRAIN0


def test_the_watchdog_names_dumps_and_kills_a_stopped_process(tmp_path, capsys):
    """A real process stopped with SIGSTOP cannot run a handler: the launcher's thread reads
    its stacks from outside and kills it."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        folder = tmp_path / "heartbeat"
        slot = Slot(folder, SlotName(0, 0, -1, child.pid))
        slot.mark(Phase.STEP, 3)
        time.sleep(0.3)  # the interpreter is in its loop
        child.send_signal(signal.SIGSTOP)
        plan = WatchPlan(folder, 0.5, tmp_path / "logs", max_restarts=0)
        started = time.monotonic()
        with Watchdog(plan) as watchdog:
            while not watchdog.hangs and time.monotonic() - started < 10:
                time.sleep(0.05)
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert time.monotonic() - started < 3
    finally:
        child.kill()
        child.wait()
    err = capsys.readouterr().err
    assert "watchdog: rank 0 (host " in err and f"pid {child.pid})" in err
    assert "phase forward-backward" in err and "ending the run (--max_restarts 0" in err
    stacks = (tmp_path / "logs" / "hang" / "attempt0-rank0.txt").read_text()
    assert "state T" in stacks
    # The verdict as an event for the report page, beside the line for people.
    (hang,) = read_events(tmp_path / "logs" / LAUNCHER_EVENTS)
    assert (hang["kind"], hang["rank"], hang["attempt"]) == ("hang", 0, 0)
    assert hang["text"].startswith("watchdog: rank 0 (host ") and hang["stacks"].endswith(
        "attempt0-rank0.txt"
    )
    assert "<module>" in stacks or "/proc/" in stacks  # py-spy's Python stack, or the kernel's


def test_an_error_inside_the_watch_is_one_line_and_the_watch_goes_on(tmp_path, capsys, monkeypatch):
    """An error in the watchdog's loop (the TypeError of issue 37 ended its thread with one
    traceback on stderr, the run going on unwatched): one line on the console and in the log,
    the traceback in the log, once however often it repeats; a stopped process is still named."""
    from imgtrainer.run import watchdog as module

    real, calls = module.read_slots, [0]

    def failing_read_slots(folder, ignored):
        calls[0] += 1
        if calls[0] <= 3:  # the same error at three polls in a row
            raise RuntimeError("injected by the test")
        return real(folder, ignored)

    monkeypatch.setattr(module, "read_slots", failing_read_slots)
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        folder = tmp_path / "heartbeat"
        Slot(folder, SlotName(0, 0, -1, child.pid)).mark(Phase.STEP, 3)
        child.send_signal(signal.SIGSTOP)
        log_file = tmp_path / "logs" / "torchrun.log"
        log_file.parent.mkdir()
        plan = WatchPlan(folder, 0.5, tmp_path / "logs", 0, log_file)
        started = time.monotonic()
        with Watchdog(plan) as watchdog:
            while not watchdog.hangs and time.monotonic() - started < 10:
                time.sleep(0.05)
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    assert watchdog.errors == 3
    err = capsys.readouterr().err.splitlines()
    errors = [line for line in err if "error while watching" in line]
    assert errors == [
        "watchdog: error while watching (RuntimeError: injected by the test, at "
        f"test_watchdog.py:{failing_read_slots.__code__.co_firstlineno + 3}); still watching; "
        f"traceback in {log_file}"
    ]
    assert "Traceback" not in "\n".join(err)
    assert any(line.startswith("watchdog: rank 0 (host ") for line in err), err
    log = log_file.read_text()
    assert log.count("error while watching") == 1 and "made no progress" in log
    assert "Traceback (most recent call last):" in log and 'raise RuntimeError("injected' in log


def test_stacks_that_cannot_be_written_do_not_spare_the_stuck_process(tmp_path, capsys):
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        folder = tmp_path / "heartbeat"
        Slot(folder, SlotName(0, 0, -1, child.pid)).mark(Phase.STEP, 3)
        child.send_signal(signal.SIGSTOP)
        (tmp_path / "logs").write_text("a file where the log folder should be")
        watchdog = Watchdog(WatchPlan(folder, 0.5, tmp_path / "logs", 0))
        watchdog.judge.observe(read_slots(folder, set()))
        time.sleep(0.6)
        watchdog.watch_once()
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    line = capsys.readouterr().err.strip()
    assert "stacks: " in line and "(not written: NotADirectoryError: " in line, line


def test_after_a_hang_the_run_ends_with_its_code_and_no_healthy_rank_is_blamed(tmp_path, capsys):
    hang, clock = judge({101: "T"})
    hang.observe({RANK0: beat(12), RANK1: beat(10)})
    clock.now = 3.0
    verdict = hang.observe({RANK0: beat(12), RANK1: beat(10)})
    healthy = {"rank": 0, "attempt": 0, "code": 1, "line": "error: RuntimeError: gloo: "
               "Connection closed by peer", "traceback": "Traceback ...", "time": 1.0}  # fmt: skip
    log_file = tmp_path / "torchrun.log"
    assert outcome.exit_code(1, [healthy], [], log_file, [verdict]) == EXIT_HUNG
    err = capsys.readouterr().err
    assert "rank 0" not in err and "Traceback" not in err
    assert "error: rank 1 (pid 101) made no progress" in err and "--resume auto" in err
    # A later attempt that failed otherwise is reported as usual.
    later = {**healthy, "attempt": 1, "line": "error: ValueError: bad", "traceback": ""}
    assert outcome.exit_code(1, [later], [], log_file, [verdict]) == 1
    assert "error: rank 0: ValueError: bad" in capsys.readouterr().err


def figures(window: float, waited: float, stepping: float, steps: int = 10) -> list[float]:
    return [window, waited, stepping, steps]


def test_a_rank_slower_outside_the_step_is_named_once_after_three_agreements(caplog):
    watch = StragglerWatch(["a", "b", "c"])
    slow = [figures(10, 0.2, 9.0), figures(10, 0.1, 5.0), figures(10, 0.2, 9.1)]
    for _ in range(STRAGGLER_GATHERS - 1):
        assert watch.update(slow) == []
    assert watch.update([figures(0, 0, 0, 0)] * 3) == []  # an epoch's start: no window
    assert watch.update(slow) == [1]
    assert watch.update(slow) == []  # once
    assert "straggler: rank 1 on host b" in caplog.text and "data wait is 1%" in caplog.text
    record = watch.epoch_figures()
    assert record["rank1_outside_step_s"] == 0.5 and record["rank0_outside_step_s"] == 0.1
    assert record["rank1_data_wait_share"] == 0.01 and record["rank2_step_s"] == 1.0
    assert watch.epoch_figures() == {}


def test_an_even_run_or_a_run_interrupted_by_one_slow_window_names_nobody():
    watch = StragglerWatch(["a", "b"])
    even = [figures(10, 0.1, 9.5), figures(10, 0.1, 9.4)]  # 0.06 s vs 0.05 s: no straggler
    slow = [figures(10, 0.1, 9.5), figures(10, 0.1, 5.0)]
    for rows in (even, slow, slow, even, slow, slow, even):
        assert watch.update(rows) == []

"""The hang watchdog of launch_ddp.py: a launcher thread that names and ends a stuck process.

A thread of the launcher (a process that a frozen rank cannot freeze) reads the heartbeat slots
of this node's ranks, loader workers and decode-check processes (``heartbeat``); one
that makes no progress for --hang_timeout is named in one line, the stacks of every rank go to
<log_dir>/hang/, and the stuck process is killed so that torchrun restarts the workers
(--max_restarts) from the newest checkpoint. An error inside the watch is one line, and the
watch goes on. No torch here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from imgtrainer.errors import first_line
from imgtrainer.events import LAUNCHER_EVENTS, append_event
from imgtrainer.heartbeat import (
    CHECK_PROCESS,
    EVAL_WORKER,
    TRAIN_WORKER,
    WAITS_FOR,
    Beat,
    Phase,
    SlotName,
    read_slot,
)

# The process states of /proc/PID/stat, most suspect first: stopped (SIGSTOP, a debugger),
# uninterruptible sleep (a hung driver call or network file system), running (a busy loop);
# a process that sleeps (S) is most likely waiting for another one.
SUSPECT_STATES = "TtDR"
PY_SPY_SECONDS = 20.0
# The other ranks of an ended attempt mostly fail on their closed connections at once, but one
# waiting in DDP's backward all-reduce can stay blocked there, beyond the reach of torchrun's
# SIGTERM; one still running this long after (--hang_timeout, at most this) is killed too, so that
# torchrun does not wait its own 30 s for it before the restart.
MAX_GRACE_SECONDS = 10.0
# The stacks file of a stuck process that is not a rank: attempt{A}-rank{R}-{kind}{index}.txt.
STACKS_KIND = {TRAIN_WORKER: "worker", EVAL_WORKER: "valworker", CHECK_PROCESS: "check"}


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat ("" when the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def suspicion(state: str) -> int:
    return SUSPECT_STATES.index(state) if state and state in SUSPECT_STATES else len(SUSPECT_STATES)


@dataclass
class Seen:
    """A slot as last seen: its values, and when they last changed (the watcher's clock)."""

    beat: Beat
    changed_at: float


@dataclass(frozen=True)
class Verdict:
    """The stuck process (``culprit``: a rank or a process of its own), its rank's slot, how
    long the stale rank made no progress, and every rank's process (for their stacks)."""

    culprit: SlotName
    rank_beat: Beat
    seconds: float
    ranks: tuple[SlotName, ...]


@dataclass
class HangJudge:
    """Names the process that makes no progress for ``timeout`` seconds, from the slots seen at
    each ``observe``. A rank is watched between the start and the end of its training; a loader
    worker (or a rank without workers) while a file read lasts. Among ranks that are all stale,
    the one that is stopped, else behind the others (fewer phase changes: they wait for it in a
    collective), else in a suspect state (``SUSPECT_STATES``) is named; a rank stale while it
    waits for processes of its own (``heartbeat.WAITS_FOR``: its training loader's workers in
    its data wait, its validation loader's in validation, its decode check's at the check's
    end) names the one of them in the most suspect state, if one is and the rank itself is not
    stopped."""

    timeout: float
    # Every rank of the job is on this node. Else a rank is named only on evidence (stopped, in
    # a suspect state, behind a rank of this node, or a suspect loader worker of its own): all
    # asleep at the same point, this node's ranks may be waiting for another node's.
    whole_job: bool = True
    clock: Callable[[], float] = time.monotonic
    state_of: Callable[[int], str] = process_state
    seen: dict[SlotName, Seen] = field(default_factory=dict)

    def observe(self, slots: dict[SlotName, Beat]) -> Verdict | None:
        now = self.clock()
        for name in list(self.seen):
            if name not in slots:
                del self.seen[name]
        for name, beat in slots.items():
            last = self.seen.get(name)
            if last is None or (last.beat.beat, last.beat.ticks) != (beat.beat, beat.ticks):
                self.seen[name] = Seen(beat, now)
            else:
                last.beat = beat
        ranks = {n: s for n, s in self.seen.items() if n.is_rank}
        stale = [
            n for n, s in ranks.items() if watched(s.beat) and now - s.changed_at >= self.timeout
        ]
        if not stale:
            return None
        states = {n: self.state_of(n.pid) for n in ranks if watched(ranks[n].beat)}
        if any(stopped(state) for n, state in states.items() if n not in stale):
            # A rank stopped since less than the timeout: the stale ones may wait for it (it
            # came to its stop late, on a busy machine). It is named once it is stale itself.
            return None
        rank = min(
            stale,
            key=lambda n: (
                not stopped(states[n]),
                ranks[n].beat.beat,
                suspicion(states[n]),
                ranks[n].changed_at,
                order(n),
            ),
        )
        # A rank stale where it waits for processes of its own (a batch from its loader's
        # workers, the rest of the decode check) names one of them that is stopped or busy,
        # unless it is stopped itself.
        kind = WAITS_FOR.get(ranks[rank].beat.phase)
        part = self._suspect_part(rank, kind) if kind and not stopped(states[rank]) else None
        culprit = part or rank
        behind = ranks[rank].beat.beat < max(s.beat.beat for s in ranks.values())
        if not (
            self.whole_job
            or culprit != rank
            or behind
            or suspicion(states[rank]) < len(SUSPECT_STATES)
        ):
            return None  # asleep where the others are: it may wait for another node's rank
        return self._verdict(culprit, ranks, now - ranks[rank].changed_at)

    def _suspect_part(self, rank: SlotName, kind: str) -> SlotName | None:
        """The process of ``kind`` of ``rank`` in the most suspect state (``SUSPECT_STATES``;
        on a tie the lowest index, then pid), or None when none of them is in one. A rank may
        have several of a kind with the same index: the workers of two loaders."""
        parts = [
            n
            for n in self.seen
            if n.kind == kind and not n.is_rank and (n.rank, n.attempt) == (rank.rank, rank.attempt)
        ]
        scores = {n: suspicion(self.state_of(n.pid)) for n in parts}
        best = min(parts, key=lambda n: (scores[n], order(n)), default=None)
        return best if best is not None and scores[best] < len(SUSPECT_STATES) else None

    def _verdict(self, culprit: SlotName, ranks: dict[SlotName, Seen], seconds: float) -> Verdict:
        """``seconds``: how long the stale rank made no progress."""
        owner = next(n for n in ranks if (n.rank, n.attempt) == (culprit.rank, culprit.attempt))
        ranks_first = tuple(sorted(ranks, key=lambda n: (n != owner, n.rank)))
        return Verdict(culprit, ranks[owner].beat, seconds, ranks_first)


def watched(beat: Beat) -> bool:
    return beat.phase not in (Phase.NOT_STARTED, Phase.DONE)


def stopped(state: str) -> bool:
    return state in ("T", "t")


def order(name: SlotName) -> tuple[int, int, int, int]:
    """A slot's place among others of the same standing: by rank, attempt, index, pid."""
    return name.rank, name.attempt, name.worker, name.pid


def rank_pid(verdict: Verdict) -> int:
    return next(n.pid for n in verdict.ranks if n.rank == verdict.culprit.rank)


def hang_line(verdict: Verdict, host: str, stacks: Path) -> str:
    """The one line that names the stuck process."""
    culprit, beat = verdict.culprit, verdict.rank_beat
    where = (
        f"rank {culprit.rank} (host {host}, pid {rank_pid(verdict)}) made no progress for "
        f"{verdict.seconds:.0f} s after global step {beat.step}, phase {beat.phase.words}"
    )
    if not culprit.is_rank:
        where += f"; {culprit.part} (pid {culprit.pid}) is stuck"
    return f"{where}; stacks: {stacks}"


def stacks_of(pid: int, py_spy: str | None) -> str:
    """A process's Python stacks, every thread, read from outside by ``py-spy dump
    --nonblocking`` (it works on a stopped process, which cannot run a handler of its own);
    without py-spy, its kernel stack and wait channel from /proc."""
    if py_spy:
        try:
            done = subprocess.run(
                [py_spy, "dump", "--nonblocking", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=PY_SPY_SECONDS,
            )
            if done.returncode == 0:
                return done.stdout
            fallback = f"(py-spy failed: {done.stderr.strip().splitlines()[:1]})\n"
        except (OSError, subprocess.TimeoutExpired) as err:
            fallback = f"(py-spy failed: {err})\n"
    else:
        fallback = "(no Python stacks: py-spy is not installed; pip install py-spy)\n"
    for name in ("wchan", "stack"):
        try:
            fallback += f"/proc/{pid}/{name}:\n{Path(f'/proc/{pid}/{name}').read_text()}\n"
        except OSError as err:
            fallback += f"/proc/{pid}/{name}: {err.strerror}\n"
    return fallback


def write_stacks(verdict: Verdict, path: Path, line: str) -> None:
    """The stuck process's stacks first, then every rank's of this node."""
    py_spy = shutil.which("py-spy")
    pids = [(verdict.culprit.who, verdict.culprit.pid)]
    pids += [(n.who, n.pid) for n in verdict.ranks if n.pid != verdict.culprit.pid]
    parts = [line, ""]
    for who, pid in pids:
        parts += [
            f"===== {who}, pid {pid}, state {process_state(pid) or 'gone'}",
            stacks_of(pid, py_spy),
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))


def alive(pid: int) -> bool:
    return process_state(pid) not in ("", "Z", "X")


def read_slots(folder: Path, ignored: set[int]) -> dict[SlotName, Beat]:
    """The slots of live processes; those of ended ones are removed."""
    slots = {}
    for path in folder.glob("*.hb"):
        name = SlotName.parse(path.name)
        if name is None or name.pid in ignored:
            continue
        if not alive(name.pid):
            path.unlink(missing_ok=True)
            continue
        beat = read_slot(path)
        if beat is not None:
            slots[name] = beat
    return slots


@dataclass
class WatchPlan:
    """What the launcher's watchdog needs: the slots' folder, --hang_timeout, where the stacks
    go, --max_restarts, and a log to copy its lines to (torchrun.log)."""

    folder: Path
    timeout: float
    log_dir: Path
    max_restarts: int
    log_file: Path | None = None
    whole_job: bool = True  # every rank of the job runs on this node (``HangJudge``)


class Watchdog:
    """The launcher's thread that watches the slots (``HangJudge``) and acts on a verdict."""

    def __init__(self, plan: WatchPlan):
        self.plan = plan
        self.judge = HangJudge(plan.timeout, plan.whole_job)
        self.hangs: list[tuple[Verdict, str]] = []  # each verdict and its line
        self.ended: set[int] = set()  # the processes of attempts it ended: no longer judged
        self.lingering: dict[SlotName, float] = {}  # their ranks, and when they must be gone
        self.host = socket.gethostname()
        self.errors = 0  # errors inside the watch, each reported once (``report_error``)
        self.errors_seen: set[tuple[type, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        interval = min(1.0, self.plan.timeout / 4)
        while not self._stop.wait(interval):
            try:
                self.watch_once()
            except Exception as err:  # a watcher that dies in silence is worse than none
                self.report_error(err)

    def watch_once(self) -> None:
        verdict = self.judge.observe(read_slots(self.plan.folder, self.ended))
        if verdict is not None:
            self.act(verdict)
        self.end_lingering()

    def report_error(self, err: Exception) -> None:
        """An error inside the watch: one line on the console and in torchrun.log, with its
        traceback in the log, once per kind and place (a poll that fails every second repeats
        nothing); the thread goes on watching."""
        frame = traceback.extract_tb(err.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        self.errors += 1
        if (type(err), where) in self.errors_seen:
            return
        self.errors_seen.add((type(err), where))
        log = f"; traceback in {self.plan.log_file}" if self.plan.log_file else ""
        self.say(
            f"watchdog: error while watching ({first_line(err)}, at {where}); still watching{log}"
        )
        self.say("".join(traceback.format_exception(err)).rstrip(), console=False, kind=None)

    def end_lingering(self) -> None:
        now = time.monotonic()
        for name, deadline in list(self.lingering.items()):
            if not alive(name.pid):
                del self.lingering[name]
            elif now > deadline:
                del self.lingering[name]
                self.say(
                    f"watchdog: {name.who} (pid {name.pid}) of the ended attempt still ran: killed",
                    console=False,
                )
                with contextlib.suppress(ProcessLookupError):
                    signal_pid(name.pid)

    def act(self, verdict: Verdict) -> None:
        """Stacks, the line, then SIGKILL to the stuck process (and to its rank, for a loader
        worker): torchrun sees a failed worker and restarts the group, or gives up."""
        culprit = verdict.culprit
        suffix = "" if culprit.is_rank else f"-{STACKS_KIND[culprit.kind]}{culprit.worker}"
        stacks = (
            self.plan.log_dir / "hang" / f"attempt{culprit.attempt}-rank{culprit.rank}{suffix}.txt"
        )
        line = hang_line(verdict, self.host, stacks)
        try:
            write_stacks(verdict, stacks, line)
        except OSError as err:  # a full or read-only log folder must not spare the stuck process
            line += f" (not written: {first_line(err)})"
        left = self.plan.max_restarts - culprit.attempt
        then = (
            f"restarting the workers from the newest checkpoint (restart {culprit.attempt + 1} "
            f"of --max_restarts {self.plan.max_restarts})"
            if left > 0
            else f"ending the run (--max_restarts {self.plan.max_restarts}: none left)"
        )
        where = {"rank": culprit.rank, "attempt": culprit.attempt, "stacks": str(stacks)}
        self.say(f"watchdog: {line}; {then}", kind="hang", **where)
        self.hangs.append((verdict, line))
        self.ended.update(n.pid for n in self.judge.seen)
        for pid in {culprit.pid, rank_pid(verdict)}:
            with contextlib.suppress(ProcessLookupError):
                signal_pid(pid)
        deadline = time.monotonic() + min(self.plan.timeout, MAX_GRACE_SECONDS)
        for name in verdict.ranks:
            if name.pid != rank_pid(verdict):
                self.lingering[name] = deadline

    def say(self, text: str, console: bool = True, kind: str | None = "watchdog", **fields) -> None:
        """``text`` on the console and in torchrun.log, and an event of ``kind`` with ``fields``
        for the report (none for a traceback)."""
        if kind is not None:
            append_event(self.plan.log_dir / LAUNCHER_EVENTS, kind, text=text, **fields)
        if console:
            with contextlib.suppress(OSError, ValueError):  # a console gone: the log still has it
                print(text, file=sys.stderr, flush=True)
        if self.plan.log_file is not None:
            try:
                with open(self.plan.log_file, "a") as log:
                    now = time.time()
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
                    log.write(f"{stamp},{int(now * 1000) % 1000:03d} {text}\n")
            except OSError:
                pass


def signal_pid(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)

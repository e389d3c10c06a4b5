"""Progress beats for the hang watchdog: each process stores its progress in its own file.

Each rank and loader worker owns a small memory-mapped file in $IMGTRAINER_HEARTBEAT_DIR and
stores its progress there (a counter, the step, the phase): memory stores,
no system call, no collective. Another process (``run.watchdog``, in the launcher) reads the
files, so a frozen process is seen by one that is not. No torch here: the launcher reads them.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_DIR_ENV = "IMGTRAINER_HEARTBEAT_DIR"


class Phase(enum.IntEnum):
    """What a rank is doing. NOT_STARTED and DONE are not watched (start-up, the summary)."""

    NOT_STARTED = 0
    DATA = 1
    STEP = 2
    COLLECTIVE = 3
    VALIDATION = 4
    CHECKPOINT = 5
    DONE = 6
    DATA_CHECK = 7  # waiting for the rest of the decode check (data.layouts.decode_check)

    @property
    def words(self) -> str:
        return PHASE_WORDS[self]


PHASE_WORDS = {
    Phase.NOT_STARTED: "starting",
    Phase.DATA: "data wait",
    Phase.STEP: "forward-backward (with DDP's gradient all-reduce)",
    Phase.COLLECTIVE: "collective",
    Phase.VALIDATION: "validation",
    Phase.CHECKPOINT: "checkpoint",
    Phase.DONE: "done",
    Phase.DATA_CHECK: "waiting for the images' decode check",
}

# The kinds of process a slot belongs to, by the letter of its file name: a rank ("w" with
# worker -1), a worker of a training loader, of an evaluation loader (the validation), or a
# process of the images' decode check.
TRAIN_WORKER, EVAL_WORKER, CHECK_PROCESS = "w", "v", "c"
KIND_WORDS = {
    TRAIN_WORKER: "loader worker",
    EVAL_WORKER: "validation loader worker",
    CHECK_PROCESS: "decode-check process",
}

# The processes of its own that a rank waits for in a phase: a rank stale there names one of
# them that is stopped or busy (``run.watchdog.HangJudge``).
WAITS_FOR = {
    Phase.DATA: TRAIN_WORKER,
    Phase.VALIDATION: EVAL_WORKER,
    Phase.DATA_CHECK: CHECK_PROCESS,
}

# beat (phase changes: the same sequence on every rank), ticks (any other progress, such as a
# validation batch), global step, phase.
_HEAD = struct.Struct("<qqqq")
SLOT_BYTES = _HEAD.size


@dataclass(frozen=True)
class SlotName:
    """Who owns a slot, from its file name: ``rank{R}.a{attempt}.{kind}{worker}.p{pid}.hb``
    (worker -1: the rank's own process; ``kind``: one of ``KIND_WORDS``)."""

    rank: int
    attempt: int
    worker: int
    pid: int
    kind: str = TRAIN_WORKER

    @property
    def file_name(self) -> str:
        return f"rank{self.rank}.a{self.attempt}.{self.kind}{self.worker}.p{self.pid}.hb"

    @classmethod
    def parse(cls, name: str) -> SlotName | None:
        try:
            rank, attempt, worker, pid, _ = name.split(".")
            if worker[:1] not in KIND_WORDS:
                return None
            return cls(int(rank[4:]), int(attempt[1:]), int(worker[1:]), int(pid[1:]), worker[0])
        except ValueError:
            return None

    @property
    def is_rank(self) -> bool:
        return self.worker < 0

    @property
    def part(self) -> str:
        """What it is to its rank: "it" for the rank itself, else its kind and index."""
        return "it" if self.is_rank else f"its {KIND_WORDS[self.kind]} {self.worker}"

    @property
    def who(self) -> str:
        if self.is_rank:
            return f"rank {self.rank}"
        return f"{KIND_WORDS[self.kind]} {self.worker} of rank {self.rank}"


@dataclass(frozen=True)
class Beat:
    """One reading of a slot."""

    beat: int
    ticks: int
    step: int
    phase: Phase


class Slot:
    """This process's heartbeat file, mapped in memory; every store is a memory write."""

    def __init__(self, folder: Path, name: SlotName):
        self.path = folder / name.file_name
        folder.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:
            f.write(bytes(SLOT_BYTES))
        with open(self.path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), SLOT_BYTES)
        self.beat = self.ticks = self.step = 0
        self.phase = Phase.NOT_STARTED

    def mark(self, phase: Phase, step: int | None = None) -> None:
        self.beat += 1
        self.phase = phase
        if step is not None:
            self.step = step
        struct.pack_into("<q", self.map, 0, self.beat)
        struct.pack_into("<qq", self.map, 16, self.step, self.phase)

    def tick(self) -> None:
        self.ticks += 1
        struct.pack_into("<q", self.map, 8, self.ticks)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.map.close()
            self.path.unlink()


def read_slot(path: Path) -> Beat | None:
    """A slot's current values (None if it is gone or short)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < SLOT_BYTES:
        return None
    beat, ticks, step, phase = _HEAD.unpack_from(data)
    try:
        phase = Phase(phase)
    except ValueError:  # a torn read: treated as progress by whoever compares beats
        phase = Phase.NOT_STARTED
    return Beat(beat, ticks, step, phase)


# ----------------------------------------------------------------------------- this process

_slot: list[Slot] = []  # this process's slot, once opened (a forked worker replaces it)


def heartbeat_dir() -> Path | None:
    folder = os.environ.get(HEARTBEAT_DIR_ENV)
    return Path(folder) if folder else None


def open_slot(rank: int, attempt: int, worker: int = -1, kind: str = TRAIN_WORKER) -> Slot | None:
    """This process's slot, where the launcher watches ($IMGTRAINER_HEARTBEAT_DIR); None
    elsewhere (a plain run, or --hang_timeout off). ``worker``, ``kind``: see ``SlotName``."""
    folder = heartbeat_dir()
    if folder is None:
        _slot.clear()
        return None
    try:
        slot = Slot(folder, SlotName(rank, attempt, worker, os.getpid(), kind))
    except OSError:
        return None
    _slot[:] = [slot]
    return slot


def mark(phase: Phase, step: int | None = None) -> None:
    """This process's phase (and step): a no-op without a slot, or before ``start``."""
    if _slot and _slot[0].phase is not Phase.NOT_STARTED and _slot[0].phase is not Phase.DONE:
        _slot[0].mark(phase, step)


def tick() -> None:
    """Progress within a phase (a validation batch); ranks may tick different numbers of times."""
    if _slot:
        _slot[0].tick()


def start(step: int) -> None:
    """Training starts: from here on the launcher watches this rank."""
    if _slot:
        _slot[0].mark(Phase.DATA, step)


def finish() -> None:
    """Training is over (done, stopped or failed): no longer watched."""
    if _slot:
        _slot[0].mark(Phase.DONE)


@contextlib.contextmanager
def phase(name: Phase) -> Iterator[None]:
    """``name`` for the block, then the phase before it again (a collective inside a step)."""
    if not _slot:
        yield
        return
    before = _slot[0].phase
    mark(name)
    try:
        yield
    finally:
        mark(before)

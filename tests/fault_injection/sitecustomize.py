"""Fault injection for the crash-resume tests, loaded at interpreter start-up from PYTHONPATH
(``conftest.kill_at``) by the launcher, torchrun and every worker. Each fault is a hook that
this module names in $IMGTRAINER_HOOKS (``imgtrainer.hooks.declared_hooks``), inherited by
every process the run starts.

TRAIN_DDP_KILL_AT="EPOCH:STEP[:RANK]" makes that rank (every rank if RANK is left out) SIGKILL
itself right after that optimizer step of that epoch (1-based), on the first torchrun attempt
only, so the restarted workers run on. The kill comes after the EMA update and the position of
that step, before its checkpoint (``kill_hook``).

TRAIN_DDP_RECORD_INDICES=DIR makes every rank append, after each optimizer step, the training
indices that step used to DIR/indices.jsonl (``record_indices``): one JSON line with the run
attempt (its start position, world size and
torchrun restart), epoch, step, rank, world size and indices. The loader reads the sampler lazily with
--num_workers 0, so the keys the sampler gave since the last step are that step's batch.

TRAIN_DDP_FREEZE="ATTEMPT:EPOCH:STEP:RANK:WHERE[,...]" freezes a process with SIGSTOP on that
torchrun attempt (``freeze_hook``): WHERE "rank" stops the rank after that step, "collective" stops
it inside the checkpoint's collective of that step (the other ranks enter it once it is
stopped), "worker" stops
its loader worker 0 inside its STEP-th file read of that attempt (EPOCH is not used), "valworker"
its validation loader's worker 0 (forked at the attempt's first validation).

WHERE "WHO@PHASE" freezes at a phase the rank marks in its heartbeat slot (PHASE: data,
validation, checkpoint, check: the decode check's end) at EPOCH:STEP, the rank's position then
(trainer.epoch + 1, trainer.step: an epoch's first data wait is E:0, its validation and check
E:<steps per epoch>, its end-of-epoch checkpoint E+1:0): the rank stops itself (WHO "rank"), or
stops its training loader's worker 0 ("worker"), its validation loader's worker 0
("valworker") or its decode check's processes ("check": held in their first task from the
start of that attempt, so that they still run). "rank@write" stops the rank inside its
checkpoint's torch.save at EPOCH:STEP (the temporary file written, not renamed). After it stops
another process, the rank logs each later wait for processes of its own ("waits for"), so that
the test knows when it began to wait for the frozen one.

TRAIN_DDP_SLOW="ATTEMPT:SECONDS:RANK" makes that rank sleep SECONDS after each step on that torchrun
attempt: a straggler (``slow_rank``).

TRAIN_DDP_STEP_DELAY="SECONDS:WORLD" makes every rank of a run on WORLD processes wait up to
SECONDS after each optimizer step (after its checkpoint), cut short by a stop signal: a run that
is still training when another node joins (``step_delay``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

KILL_AT_ENV = "TRAIN_DDP_KILL_AT"
RECORD_ENV = "TRAIN_DDP_RECORD_INDICES"
DELAY_ENV = "TRAIN_DDP_STEP_DELAY"
HOOKS_ENV = "IMGTRAINER_HOOKS"  # imgtrainer.hooks.HOOKS_ENV (not imported: torch at start-up)
# A child of the project logger, so the message reaches the rank's log file.
LOGGER = "imgtrainer.fault_injection"


def kill_point(rank: int) -> tuple[int, int] | None:
    """The (epoch, step) at which this rank must kill itself."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    kill_epoch, kill_step, *kill_rank = (int(part) for part in spec.split(":"))
    return (kill_epoch, kill_step) if not kill_rank or kill_rank[0] == rank else None


def kill_hook(trainer):
    """The ``FaultInjection`` hook of $TRAIN_DDP_KILL_AT, or None where this rank survives."""
    from imgtrainer.hooks import Hook

    class FaultInjection(Hook):
        before_checkpoint = True

        def __init__(self, point: tuple[int, int]):
            self.point = point

        def on_step_end(self, info) -> bool:
            epoch, rank = trainer.epoch + 1, trainer.dist.rank
            if self.point == (epoch, info.step):
                logging.getLogger(LOGGER).warning(
                    f"{KILL_AT_ENV}: killing rank {rank} with SIGKILL at epoch {epoch}, "
                    f"step {info.step}"
                )
                os.kill(os.getpid(), signal.SIGKILL)
            return False

    point = kill_point(trainer.dist.rank)
    return None if point is None else FaultInjection(point)


def record_indices(trainer):
    """A hook that records each step's training indices in $TRAIN_DDP_RECORD_INDICES."""
    from imgtrainer.hooks import Hook

    folder = os.environ[RECORD_ENV]

    class RecordIndices(Hook):
        before_checkpoint = True

        def __init__(self):
            # The same on every rank of one attempt: where it started, on how many processes.
            self.attempt = (
                f"{trainer.epoch}:{trainer.step}:{trainer.dist.world_size}:"
                f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            )
            self.keys: list[tuple[int, int]] = []
            sampler = trainer.loaders.sampler
            base = type(sampler)

            def recording_iter(this):
                for key in base.__iter__(this):
                    self.keys.append(key)
                    yield key

            # The loader holds this sampler: a subclass of its own class records what it gives.
            sampler.__class__ = type(
                "Recording" + base.__name__, (base,), {"__iter__": recording_iter}
            )

        def on_step_end(self, info) -> bool:
            record = {
                "attempt": self.attempt,
                "epoch": trainer.epoch,
                "step": info.step,
                "rank": trainer.dist.rank,
                "world_size": trainer.dist.world_size,
                "indices": [index for index, _ in self.keys],
            }
            self.keys.clear()
            with open(os.path.join(folder, "indices.jsonl"), "a") as out:
                out.write(json.dumps(record) + "\n")
            return False

    return RecordIndices()


def step_delay(trainer):
    """A hook that waits after each step (after its checkpoint) at $TRAIN_DDP_STEP_DELAY's world
    size, or None at another."""
    from imgtrainer.hooks import Hook

    seconds, world = os.environ[DELAY_ENV].split(":")

    class StepDelay(Hook):
        def on_step_end(self, info) -> bool:
            # Polled, so a stop signal (the agent stopping its workers) ends the wait at once.
            end = time.monotonic() + float(seconds)
            while trainer.stop.signum is None and time.monotonic() < end:
                time.sleep(0.05)
            return False

    return StepDelay() if trainer.dist.world_size == int(world) else None


FREEZE_ENV = "TRAIN_DDP_FREEZE"


def freeze_points(attempt: str) -> list[tuple[int, int, int, str]]:
    """$TRAIN_DDP_FREEZE's (epoch, step, rank, where) for this torchrun attempt."""
    points = []
    for spec in filter(None, os.environ.get(FREEZE_ENV, "").split(",")):
        at, epoch, step, rank, where = spec.split(":")
        if at == attempt:
            points.append((int(epoch), int(step), int(rank), where))
    return points


def freeze_hook(trainer):
    """The ``Freeze`` hook of $TRAIN_DDP_FREEZE on this attempt, or None."""
    import threading

    from imgtrainer.hooks import Hook

    points = freeze_points(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = trainer.dist.rank
    say = logging.getLogger(LOGGER).warning
    for _, reads, frozen_rank, where in points:
        if where in ("worker", "valworker") and frozen_rank == rank:
            freeze_worker_in_read(rank, reads, FROZEN_KINDS[where], say)
    at_phases = [(e, s, w) for e, s, r, w in points if "@" in w and r == rank]
    if at_phases:
        freeze_at_phases(trainer, at_phases, say)

    class Freeze(Hook):
        before_checkpoint = True

        def on_step_end(self, info) -> bool:
            for epoch, step, frozen_rank, where in points:
                if (epoch, step) != (trainer.epoch + 1, info.step) or where not in (
                    "rank",
                    "collective",
                ):
                    continue
                if frozen_rank != rank:
                    if where == "collective":
                        wait_until_stopped(frozen_rank)  # it waits in the collective meanwhile
                    continue
                say(f"{FREEZE_ENV}: freezing rank {rank} ({where}) at epoch {epoch}, step {step}")
                if where == "rank":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:  # inside the collective this step's checkpoint starts with
                    threading.Thread(target=stop_in_collective, daemon=True).start()
            return False

    return Freeze() if points else None


def stop_in_collective() -> None:
    """SIGSTOP to this process once its main thread is inside a torch.distributed call."""
    import threading

    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        while frame is not None and "distributed_c10d" not in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is not None:
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        time.sleep(0.01)


def wait_until_stopped(rank: int) -> None:
    """Until this attempt's rank ``rank`` (found by its heartbeat slot) is stopped, at most 5
    minutes."""
    from imgtrainer import heartbeat

    pattern = f"rank{rank}.a{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.w-1.p*.hb"
    end = time.monotonic() + 300
    while time.monotonic() < end:
        for path in heartbeat.heartbeat_dir().glob(pattern):
            stat = Path(f"/proc/{path.name.split('.p')[-1][:-3]}/stat")
            with contextlib.suppress(OSError):
                if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":
                    return
        time.sleep(0.02)


def freeze_worker_in_read(rank: int, reads: int, kind: str, say) -> None:
    """Worker 0 of this rank's training loader (``kind`` "w") or validation loader ("v") stops
    itself inside its ``reads``-th image read (forked after this, the workers inherit the
    patch; the validation loader's at the attempt's first validation)."""
    from imgtrainer import heartbeat
    from imgtrainer.data.layouts.table import TableImages

    real, count = TableImages.open_rgb, [0]
    who = "loader worker 0" if kind == "w" else "validation loader worker 0"

    def open_rgb(images, i):
        slot = heartbeat._slot[0] if heartbeat._slot else None
        if slot is not None and slot.path.name.split(".")[2] == f"{kind}0":
            count[0] += 1
            if count[0] == reads:
                say(
                    f"{FREEZE_ENV}: freezing {who} of rank {rank} reading {images.table.location(i)}"
                )
                os.kill(os.getpid(), signal.SIGSTOP)
        return real(images, i)

    TableImages.open_rgb = open_rgb


# The slot letter of each process a rank can freeze (``heartbeat.SlotName.kind``), by WHO.
FROZEN_KINDS = {"worker": "w", "valworker": "v", "check": "c"}


def freeze_at_phases(trainer, points: list[tuple[int, int, str]], say) -> None:
    """``freeze_hook``'s WHO@PHASE points: ``heartbeat.mark`` (and for "rank@write"
    ``torch.save``) wrapped in this rank."""
    from imgtrainer import heartbeat

    phases = {
        "data": heartbeat.Phase.DATA,
        "validation": heartbeat.Phase.VALIDATION,
        "checkpoint": heartbeat.Phase.CHECKPOINT,
        "check": heartbeat.Phase.DATA_CHECK,
    }
    rank, attempt = trainer.dist.rank, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    pending = set(points)
    stopped_others: list[int] = []

    def fire(point: tuple[int, int, str]) -> None:
        pending.discard(point)
        epoch, step, where = point
        who = where.split("@")[0]
        at = f"{where.split('@')[1]} of epoch {epoch}, step {step}"
        if who == "rank":
            say(f"{FREEZE_ENV}: freezing rank {rank} at {at}")
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        index = "*" if who == "check" else "0"
        pattern = f"rank{rank}.a{attempt}.{FROZEN_KINDS[who]}{index}.p*.hb"
        pids = sorted(
            int(p.name.split(".p")[-1][:-3]) for p in heartbeat.heartbeat_dir().glob(pattern)
        )
        say(f"{FREEZE_ENV}: freezing {who} of rank {rank} (pids {pids}) at {at}")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stopped_others.extend(pids)

    real_mark = heartbeat.mark

    def mark(phase, step=None):
        real_mark(phase, step)
        epoch, at = trainer.epoch + 1, trainer.step
        if stopped_others and phase in heartbeat.WAITS_FOR:
            say(f"{FREEZE_ENV}: rank {rank} waits for {phase.words} at epoch {epoch}, step {at}")
        for point in list(pending):
            e, s, where = point
            if (
                (e, s) == (epoch, at)
                and where != "rank@write"
                and phases[where.split("@")[1]] == phase
            ):
                fire(point)

    heartbeat.mark = mark
    if any(where == "rank@write" for _, _, where in points):
        freeze_in_write(trainer, pending, say)


def freeze_in_write(trainer, pending: set[tuple[int, int, str]], say) -> None:
    """The "rank@write" points of ``pending``: ``torch.save`` wrapped in this rank, which
    stops once a checkpoint is written to its temporary file at the point."""
    import torch

    real_save, rank = torch.save, trainer.dist.rank

    def save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if not (isinstance(obj, dict) and "model_state_dict" in obj):
            return  # not a checkpoint (all_gather_object pickles with torch.save too)
        for point in list(pending):
            e, s, where = point
            if where == "rank@write" and (e, s) == (trainer.epoch + 1, trainer.step):
                say(
                    f"{FREEZE_ENV}: freezing rank {rank} inside its checkpoint's write at "
                    f"epoch {e}, step {s}"
                )
                pending.discard(point)
                os.kill(os.getpid(), signal.SIGSTOP)

    torch.save = save


def hold_check_processes(module) -> None:
    """The decode check's processes of the attempts and ranks that $TRAIN_DDP_FREEZE freezes
    with "check@..." wait in their first task (forever: the rank stops them at its point), so
    that the check still runs then, however few images it has."""
    from imgtrainer import heartbeat

    real = module.DecodeCheck.rows

    def rows(self, role, start, stop):
        slot = heartbeat._slot[0] if heartbeat._slot else None
        if slot is not None and slot.path.name.split(".")[2].startswith("c"):
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            rank = int(os.environ.get("RANK", "0"))
            if any(p[2] == rank and p[3].startswith("check@") for p in freeze_points(attempt)):
                while True:
                    time.sleep(1.0)
        return real(self, role, start, stop)

    module.DecodeCheck.rows = rows


class PatchOnImport:
    """A finder that runs ``patch(module)`` once ``name`` is imported (a module that imports
    torch: the launcher never imports it; torchrun's agent does, before it forks the ranks)."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


SLOW_ENV = "TRAIN_DDP_SLOW"


def slow_rank(trainer):
    """A hook that makes $TRAIN_DDP_SLOW's rank sleep after each step, or None elsewhere."""
    from imgtrainer.hooks import Hook

    attempt, seconds, rank = os.environ[SLOW_ENV].split(":")
    here = (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), trainer.dist.rank)

    class SlowRank(Hook):
        def on_step_end(self, info) -> bool:
            time.sleep(float(seconds))
            return False

    return SlowRank() if here == (attempt, int(rank)) else None


# Each fault's variable and hook, in the order the hooks run: the recorder sees a step before
# the kill does.
FAULTS = {
    RECORD_ENV: "record_indices",
    KILL_AT_ENV: "kill_hook",
    FREEZE_ENV: "freeze_hook",
    DELAY_ENV: "step_delay",
    SLOW_ENV: "slow_rank",
}


def declare_hooks(environ=os.environ) -> None:
    """Name the hooks of the faults asked for in $IMGTRAINER_HOOKS (once: the processes that
    this one starts inherit them)."""
    declared = [e for e in environ.get(HOOKS_ENV, "").split(",") if e]
    for variable, factory in FAULTS.items():
        entry = f"{__name__}:{factory}"
        if environ.get(variable) and entry not in declared:
            declared.append(entry)
    if declared:
        environ[HOOKS_ENV] = ",".join(declared)


declare_hooks()
if "check@" in os.environ.get(FREEZE_ENV, ""):
    sys.meta_path.insert(
        0, PatchOnImport("imgtrainer.data.layouts.decode_check", hold_check_processes)
    )

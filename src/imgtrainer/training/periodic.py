"""The per-step hooks of checkpointing: the position a checkpoint records (``PositionKeeper``),
and when one is written mid-epoch (``CheckpointAndStop``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from imgtrainer.hooks import Hook, StepInfo
from imgtrainer.training.run_state import Progress
from imgtrainer.training.stopping import StopRequest


class PositionKeeper(Hook):
    """Keeps the run's progress (for checkpoints and the stop message) after every step."""

    def __init__(self, progress: Progress):
        self.progress = progress

    def on_step_end(self, info: StepInfo) -> bool:
        self.progress.step = info.step
        return False


@dataclass
class SaveSchedule:
    """When a checkpoint is written inside an epoch: every ``steps`` steps (--save_every_steps;
    0: not by count) and, at the ranks' next agreement, once ``seconds`` passed since the last
    checkpoint of any kind (--save_every_minutes; 0: not by time)."""

    steps: int
    seconds: float
    clock: Callable[[], float] = time.monotonic
    last: float = field(default=0.0, init=False)

    def __post_init__(self):
        self.last = self.clock()

    def by_count(self, step: int) -> bool:
        """A --save_every_steps checkpoint after this step of the epoch."""
        return bool(self.steps) and step % self.steps == 0

    def due(self) -> bool:
        """--save_every_minutes passed since the last checkpoint, on this rank's clock."""
        return bool(self.seconds) and self.clock() - self.last >= self.seconds

    def saved(self) -> None:
        """A checkpoint was written (of any kind, an epoch's own too): the time starts again."""
        self.last = self.clock()


class CheckpointAndStop(Hook):
    """The agreed stop on a signal or the --max_time budget (with a checkpoint), and the
    periodic checkpoint of --save_every_steps and --save_every_minutes (``SaveSchedule``). Every
    rank runs it: all are collectives; only the main process writes. Under torch.distributed
    the ranks agree on a stop, and on a checkpoint due by time (any rank's clock), only every
    few steps (``StopRequest.agrees_at``) and at each periodic checkpoint, so --max_time looks
    that far ahead."""

    def __init__(
        self,
        stop: StopRequest,
        # a step ended (at the epoch's end?, steps to the next agreement): out of time?
        time_up: Callable[[bool, int], bool],
        save: Callable[[torch.Tensor], None],  # the checkpoint, given this rank's sums
        steps_per_epoch: int,
        schedule: SaveSchedule,
    ):
        self.stop, self.time_up, self.save = stop, time_up, save
        self.steps_per_epoch, self.schedule = steps_per_epoch, schedule

    def on_step_end(self, info: StepInfo) -> bool:
        at_end = info.step == self.steps_per_epoch  # the epoch's own checkpoint comes next
        ahead = self.stop.steps_to_next_agreement(info.step, self.steps_per_epoch)
        time_up = self.time_up(at_end, ahead)  # every step: it times the steps
        saving = self.schedule.by_count(info.step) and not at_end
        # A periodic checkpoint is a collective anyway: the ranks agree there too.
        agree = saving or self.stop.agrees_at(info.step, at_end)
        stop = agree and self.stop.agreed(time_up, not at_end and self.schedule.due())
        if stop or saving or (agree and self.stop.save_agreed):
            info.flush_logs()
            self.save(info.sums)
        return stop

"""The per-step hooks of checkpointing: the position a checkpoint records (``PositionKeeper``),
and when one is written mid-epoch (``CheckpointAndStop``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from imgtrainer.checkpoints.training_state import Progress
from imgtrainer.hooks import Hook, StepInfo

if TYPE_CHECKING:  # a floor above: its types only
    from imgtrainer.training.stopping import StopRequest


class PositionKeeper(Hook):
    """Keeps the run's progress (for checkpoints and the stop message) after every step."""

    def __init__(self, progress: Progress):
        self.progress = progress

    def on_step_end(self, info: StepInfo) -> bool:
        self.progress.step = info.step
        return False


class CheckpointAndStop(Hook):
    """The agreed stop on a signal or the --max_time budget (with a checkpoint), and the
    periodic checkpoint of --save_every_steps. Every rank runs it: both are collectives; only
    the main process writes. Under torch.distributed the ranks agree on a stop only every few
    steps (``StopRequest.agrees_at``) and at each periodic checkpoint, so --max_time looks that
    far ahead."""

    def __init__(
        self,
        stop: StopRequest,
        # a step ended (at the epoch's end?, steps to the next agreement): out of time?
        time_up: Callable[[bool, int], bool],
        save: Callable[[torch.Tensor], None],  # the checkpoint, given this rank's sums
        steps_per_epoch: int,
        every: int,  # --save_every_steps; 0: only at the epochs' ends
    ):
        self.stop, self.time_up, self.save = stop, time_up, save
        self.steps_per_epoch, self.every = steps_per_epoch, every

    def on_step_end(self, info: StepInfo) -> bool:
        at_end = info.step == self.steps_per_epoch
        ahead = self.stop.steps_to_next_agreement(info.step, self.steps_per_epoch)
        time_up = self.time_up(at_end, ahead)  # every step: it times the steps
        saving = bool(self.every) and info.step % self.every == 0 and not at_end
        # A periodic checkpoint is a collective anyway: the ranks agree there too.
        agree = saving or self.stop.agrees_at(info.step, at_end)
        stop = agree and self.stop.agreed(time_up)
        if stop or saving:
            info.flush_logs()
            self.save(info.sums)
        return stop

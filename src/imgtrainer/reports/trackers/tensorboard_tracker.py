"""``--tensorboard`` (on by default): the run's TensorBoard event files, as a tracker.

Curves, hyperparameters and a grid of augmented images in <log_dir>/tensorboard, through
``reports.tensorboard.TensorBoardLogger``.
"""

from __future__ import annotations

from typing import Any

from imgtrainer.reports.tensorboard import TensorBoardLogger
from imgtrainer.reports.trackers import TrackerContext
from imgtrainer.reports.trackers.base import TrackerHook

# The training metrics of a logging step, as TensorBoard's train/* series names them.
STEP_SERIES = {
    "loss": "train_loss",
    "acc": "train_acc",
    "lr": "lr",
    "images_per_sec": "images_per_sec",
    "data_wait_share": "data_wait_share",
}


class Tracker(TrackerHook):
    """Its calls are not contained (``safely``) as a server's are: the event files are local,
    and a failure there is the run's own."""

    name = "tensorboard"

    def __init__(self, context: TrackerContext):
        self.context = context
        # Resumed after step N (its events written before its checkpoint), the run's next
        # event is at N + 1: what a crashed run wrote from there on goes. A new run (N = 0)
        # replaces the folder's earlier events, as it replaces the history.
        start = context.start_step
        self.logger = TensorBoardLogger(
            context.log_dir, enabled=True, purge_step=start + 1 if start else 0
        )
        self.where = str(self.logger.folder)
        if start == 0 and context.augmented_images is not None:
            images, mean, std = context.augmented_images()
            self.logger.add_image_grid(images, mean=mean, std=std)

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        series = {name: metrics[key] for name, key in STEP_SERIES.items()}
        self.logger.add_step_metrics(global_step, series)
        # On disk now (a file flush per logging step): the loop reports a step one logging step
        # late, or just before a checkpoint, so a crash after that checkpoint keeps its steps.
        self.logger.flush()

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> None:
        # At the global step where the epoch ended: one step axis for every series.
        self.logger.add_epoch_record(epoch * self.context.steps_per_epoch, record)

    def on_run_end(self, hparams: dict[str, Any], final_metrics: dict[str, Any]) -> None:
        context = self.context
        step = context.global_step() if context.global_step else context.start_step
        self.logger.add_run_end(step, hparams, final_metrics)

    def close(self) -> None:
        self.logger.close()

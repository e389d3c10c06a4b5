"""The Trainer: the epoch loop of one run, over the parts ``assemble`` built."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from imgtrainer import heartbeat
from imgtrainer.checkpoints.resume import rank_state
from imgtrainer.config import Layout
from imgtrainer.data import audit_summary
from imgtrainer.distributed.collectives import (
    all_gather_objects,
    check_ranks_in_sync,
    peak_memory_mb,
)
from imgtrainer.hooks import Hook, Hooks, declared_hooks
from imgtrainer.reports.history import EpochRecord, best_note
from imgtrainer.reports.trackers import TrackerContext
from imgtrainer.training.assemble import Assembly, main_process_trackers
from imgtrainer.training.ema import history_val_metrics
from imgtrainer.training.evaluation import epoch_validation, is_validation_epoch
from imgtrainer.training.loop import EpochPlan, ProgressBar, train_one_epoch
from imgtrainer.training.periodic import CheckpointAndStop, PositionKeeper
from imgtrainer.training.run_state import Progress, ResumeSource, checkpoint_state, restore

log = logging.getLogger(__name__)


def augmented_images(loader, sampler, count: int = 16) -> tuple[torch.Tensor, Any, Any]:
    """What the model sees: this rank's first training images of epoch 1, augmented as in
    training (the dataset draws each sample's augmentation from (seed, epoch, index)), and
    their normalisation."""
    keys = [(index, 0) for index in sampler.rank_order(0)[:count]]
    return loader.preview(keys), loader.augment.mean, loader.augment.std


def epoch_audit(train_loader) -> dict[str, float]:
    """The epoch's data audit over every rank (``data.audit_summary``); every rank takes the CPU
    path together when any rank's audits ask for it. Every rank calls it, or none
    (--audit_data_every 0)."""
    if train_loader.audit is None:
        return {}
    gathered = all_gather_objects(train_loader.audit_results())
    if any(switch for _, switch in gathered):
        train_loader.switch_to_reference()
    return audit_summary([results for results, _ in gathered])


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """The epoch loop of one run: ``resume``, then ``fit``; the parts come from their rooms."""

    def __init__(self, run: Assembly):
        self.run = run  # the parts, as ``assemble`` built them
        self.cfg, self.dist, self.parts = run.cfg, run.dist, run.parts
        self.loaders, self.train_loader = run.loaders, run.loaders.train
        self.ema, self.best, self.history, self.stop = run.ema, run.best, run.history, run.stop
        self.checkpoints, self.budget = run.checkpoints, run.budget
        self.steps_per_epoch = len(self.train_loader)
        self.progress = Progress()
        self.resumed_sums: torch.Tensor | None = None
        self.checkpoint_written = False  # by this process: a --max_time stop may rely on it
        self.hooks = Hooks()  # registered by register_hooks, once the resumed position is known

    @property
    def layout(self) -> Layout:
        return Layout.of(self.cfg, self.dist.world_size)

    @property
    def epoch(self) -> int:
        return self.progress.epoch

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def global_step(self) -> int:
        """Optimizer steps since the run began: the step axis of the TensorBoard curves."""
        return self.epoch * self.steps_per_epoch + self.step

    @property
    def position(self) -> int:
        """Samples of the epoch's global order consumed."""
        return self.progress.position(self.layout.global_batch)

    def resume(self) -> None:
        """The checkpoint found at the start (if any) into the built parts; then the hooks."""
        self.progress, self.resumed_sums = restore(
            self.run.resume_from, self.run.run_state, self.dist, self.layout, self.steps_per_epoch
        )
        self.run.resume_from = ResumeSource()  # the weights are in the model now
        self.register_hooks()

    def register_hooks(self) -> None:
        """The per-step work, in the order it runs after each step. The EMA comes first: a
        checkpoint written at a step must hold the EMA of that step's weights. The trackers
        continue from the resumed position (dropping what a crashed run wrote after it);
        instruments named in $IMGTRAINER_HOOKS come last, or before the checkpoint."""
        if len(self.hooks):
            raise RuntimeError("the trainer's hooks are already registered")
        steps = self.steps_per_epoch
        saves = CheckpointAndStop(
            self.stop, self.step_done, self.save_checkpoint, steps, self.run.saves
        )
        for hook in (self.ema, PositionKeeper(self.progress), saves, *self.trackers()):
            self.hooks.register(hook)
        for hook in declared_hooks(self):
            self.hooks.register(hook, before=CheckpointAndStop if hook.before_checkpoint else None)

    def trackers(self) -> list[Hook]:
        """TensorBoard and --log_to's trackers (``main_process_trackers``)."""
        context = TrackerContext(
            self.cfg, Path(self.cfg.log_dir), self.global_step, self.steps_per_epoch,
            global_step=lambda: self.global_step,
            augmented_images=partial(augmented_images, self.train_loader, self.loaders.sampler),
        )  # fmt: skip
        return main_process_trackers(self.cfg, self.dist, context)

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(
        self, sums: torch.Tensor | None, is_best: bool = False, epoch_end: bool = False
    ) -> None:
        """Every rank must call this: each contributes its random state and running metrics.
        At an epoch's end (``epoch_end``) the epochs' checkpoints to keep are kept. Nothing is
        saved once the loss or the weights are no longer finite."""
        self.run.nonfinite.check(self.steps_per_epoch)
        heartbeat.mark(heartbeat.Phase.CHECKPOINT)
        started = self.budget.clock()
        rank_states = all_gather_objects(rank_state(sums, self.dist.device))
        keep = self.best.kept_epochs(self.history.records) if epoch_end else None
        state = checkpoint_state(self.run.run_state, self.progress, self.layout, rank_states)
        self.checkpoints.save_with_history(state, self.history, is_best, keep)
        self.run.saves.saved()
        self.checkpoint_written = True
        self.budget.timed_save(self.budget.clock() - started)

    # -- one epoch ------------------------------------------------------------------------
    def run_epoch(self) -> bool:
        """Train and evaluate one epoch; False if a stop signal ended it early."""
        # set_epoch reshuffles: without it every epoch would visit samples in the same order.
        self.loaders.sampler.set_epoch(self.epoch, position=self.position)
        first_step, started = self.step, time.perf_counter()
        self.budget.start_steps()
        progress = ProgressBar(self.dist.is_main, f"epoch {self.epoch + 1}/{self.cfg.epochs}")
        mixer = self.loaders.mixer.for_epoch(self.epoch) if self.loaders.mixer else None
        plan = EpochPlan(
            start_step=self.step,
            first_global_step=self.global_step,
            sums=self.resumed_sums,
            log_interval=self.cfg.log_interval,
            mixer=mixer,
            nonfinite=self.run.nonfinite,
            clock=self.run.stragglers.clock if self.run.stragglers else None,
        )
        train = train_one_epoch(
            self.parts, self.train_loader, hooks=self.hooks, progress=progress, epoch=plan
        )
        self.resumed_sums = None
        if self.stop.requested_by_all:
            return False
        train_seconds = time.perf_counter() - started
        audit = epoch_audit(self.train_loader)
        # The images that do not decode, known on every rank from here (before the first
        # validation, which leaves them out): the check ran beside this epoch.
        self.loaders.check.finish()
        recorders = self.run.best_predictions.recorders(self.ema.enabled)
        val = (
            self.validate_epoch(recorders) if is_validation_epoch(self.cfg, self.epoch + 1) else {}
        )
        if self.cfg.check_sync:
            check_ranks_in_sync(self.parts.plain_model)
            if self.ema.enabled:
                check_ranks_in_sync(self.ema.module)
        self.progress.epoch, self.progress.step = self.epoch + 1, 0
        epoch = self.epoch_record(train, val, started, train_seconds, first_step)
        record = self.history.append(epoch := replace(epoch, audit=audit))
        is_best = self.best.agree(record, self.dist.is_distributed)
        if is_best:
            self.run.best_predictions.keep(recorders, self.loaders.val, record, self.best.state)
        self.save_checkpoint(None, is_best, epoch_end=True)
        self.hooks.call("on_epoch_end", self.epoch, record)
        note = best_note(self.best.state, self.ema.enabled) if is_best else ""
        log.info(epoch.line(self.cfg.epochs) + note)
        return True

    def validate_epoch(self, recorders: dict) -> dict[str, float]:
        """The epoch's validation metrics (``epoch_validation``), timed for --max_time."""
        started = self.budget.clock()
        heartbeat.mark(heartbeat.Phase.VALIDATION)
        val = epoch_validation(self.parts, self.ema, self.loaders.val, self.dist, recorders)
        self.budget.timed_validation(self.budget.clock() - started)
        return val

    def epoch_record(
        self, train: dict, val: dict, started: float, train_seconds: float, first_step: int
    ) -> EpochRecord:
        # Speed counts the steps this process ran, not those restored from a checkpoint.
        images = (train["steps"] - first_step) * self.layout.global_batch
        train_seconds = max(train_seconds, 1e-9)
        return EpochRecord(
            epoch=self.epoch,
            train_loss=train["train_loss"],
            train_acc=train["train_acc"],
            val=history_val_metrics(val),  # none for an epoch without validation
            lr=self.parts.optimizer.param_groups[0]["lr"],
            epoch_seconds=time.perf_counter() - started,
            train_images_per_sec=images / train_seconds,
            peak_memory_mb=peak_memory_mb(self.dist.device),
            micro_batch=self.parts.plan.micro_batch,
            data_wait_share=round(train["data_wait"] / train_seconds, 4),
            ranks=self.run.stragglers.epoch_figures() if self.run.stragglers else {},
        )

    def end_hooks(self, finished: bool) -> None:
        """A finished run's hyperparameters and final metrics, for the loggers among the hooks."""
        if finished and self.history.records:
            self.hooks.call("on_run_end", self.cfg.to_dict(), self.history.records[-1])

    def fit(self) -> bool:
        """Train until the last epoch or early stopping (True: the run is over), or until a
        stop signal or the --max_time budget (False: it stopped to be resumed)."""
        while self.epoch < self.cfg.epochs and not self.best.should_stop:
            # A signal that arrived during evaluation is honoured here, at an epoch boundary
            # whose checkpoint is already written; so is a budget too short for another step
            # (before this process wrote a checkpoint, the first step runs and saves one).
            time_up = self.checkpoint_written and self.time_runs_out(at_epoch_end=False)
            if self.stop.agreed(time_up) or not self.run_epoch():
                return False
        return True

    def close(self) -> None:
        """Whatever happened: the loggers flush their files, the decode check ends (a run
        that stops before the first epoch's end), the uploads to object storage finish."""
        self.hooks.call("close")
        self.loaders.check.close()
        self.checkpoints.finish()

    @property
    def stopped_early(self) -> bool:
        """Early stopping ended the run before its last epoch."""
        return self.best.should_stop and self.epoch < self.cfg.epochs

    def step_done(self, at_epoch_end: bool, steps_ahead: int = 1) -> bool:
        """A step ended: it counts for --max_time; whether the budget runs out now, before the
        ranks' next agreement ``steps_ahead`` steps on."""
        self.budget.step_done()
        return self.time_runs_out(at_epoch_end, steps_ahead)

    def time_runs_out(self, at_epoch_end: bool, steps_ahead: int = 1) -> bool:
        """--max_time: whether the work up to the next point to stop at, and a checkpoint, no
        longer fit: after an epoch's last step its validation, else the next ``steps_ahead``
        steps."""
        validation = at_epoch_end and is_validation_epoch(self.cfg, self.epoch + 1)
        batches = len(self.loaders.val) if validation else None
        return self.budget.too_short_for_next_stop(at_epoch_end, batches, steps_ahead)

"""The Trainer: the epoch loop of one run, over the parts it assembles."""

from __future__ import annotations

import logging
import platform
import socket
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import timm
import torch
import torchvision

from imgtrainer.checkpoints.periodic import CheckpointAndStop, PositionKeeper, SaveSchedule
from imgtrainer.checkpoints.resume import rank_state
from imgtrainer.checkpoints.training_state import (
    Progress,
    RunState,
    checkpoint_state,
    find_resume,
    restore,
)
from imgtrainer.checkpoints.writer import checkpoint_writer
from imgtrainer.config import Layout, TrainConfig, parse_duration
from imgtrainer.data import audit_summary, build_loaders
from imgtrainer.distributed import heartbeat
from imgtrainer.distributed.collectives import (
    all_gather_objects,
    check_ranks_in_sync,
    peak_memory_mb,
)
from imgtrainer.distributed.setup import DistInfo
from imgtrainer.errors import UserError
from imgtrainer.hooks import Hook, Hooks, declared_hooks
from imgtrainer.reports.history import EpochRecord, HistoryWriter, best_note
from imgtrainer.reports.trackers import TrackerContext, build_trackers
from imgtrainer.training.best import BestTracker
from imgtrainer.training.build import build_run_parts
from imgtrainer.training.ema import ModelEma, history_val_metrics
from imgtrainer.training.evaluation import epoch_validation, is_validation_epoch
from imgtrainer.training.loop import EpochPlan, ProgressBar, train_one_epoch
from imgtrainer.training.memory_fit import TrialParts, build_memory_plan
from imgtrainer.training.nonfinite import NonFiniteLoss
from imgtrainer.training.optim import restore_optimizer_state, restore_scheduler_state
from imgtrainer.training.predictions import BestPredictions
from imgtrainer.training.stopping import StopRequest, TimeBudget
from imgtrainer.training.stragglers import StragglerWatch

log = logging.getLogger(__name__)


def run_header(
    cfg: TrainConfig, dist: DistInfo, class_names: list[str], parts, class_counts: list[int]
) -> dict[str, Any]:
    """The history file's head: what the run is, on what, with which data (the report's)."""
    return {
        "config": cfg.to_dict(),
        "world_size": dist.world_size,
        "effective_batch_size": Layout.of(cfg, dist.world_size).global_batch,
        "device": str(dist.device.type),
        "class_names": class_names,
        "train_class_counts": class_counts,
        "command": sys.argv,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "timm": timm.__version__,
        },
        "environment": environment(dist, parts.precision),
    }


def environment(dist: DistInfo, precision) -> dict[str, Any]:
    """The main process's host, its GPUs and CUDA, and the precision of the forward pass."""
    cuda = dist.device.type == "cuda"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "host": socket.gethostname(),
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpus": gpus,
        "precision": f"{str(precision.dtype).removeprefix('torch.')} autocast"
        if precision.enabled
        else "float32",
    }


def load_optimisation(parts, ckpt: dict[str, Any], regroup: bool) -> None:
    """The optimizer's and scheduler's saved states into ``parts`` (``restore``'s hand)."""
    restore_optimizer_state(
        parts.optimizer, ckpt["optimizer_state_dict"], parts.plain_model, regroup=regroup
    )
    restore_scheduler_state(parts.scheduler, ckpt["scheduler_state_dict"])


def augmented_images(loader, count: int = 16) -> tuple[torch.Tensor, Any, Any]:
    """What the model sees: the first training images of epoch 1, augmented as in training
    (the dataset draws each sample's augmentation from (seed, epoch, index)), and their
    normalisation."""
    keys = [(index, 0) for index in range(min(count, len(loader.dataset)))]
    return loader.preview(keys), loader.augment.mean, loader.augment.std


def main_process_trackers(cfg: TrainConfig, dist: DistInfo, context: TrackerContext) -> list[Hook]:
    """TensorBoard and --log_to's trackers, on the main process; a missing package or a
    refused login there stops every rank with its line."""
    trackers, error = [], None
    if dist.is_main:
        try:
            trackers = build_trackers(cfg.log_to, context, tensorboard=cfg.tensorboard)
        except UserError as err:
            error = str(err)
    error = all_gather_objects(error)[0]
    if error is not None:
        raise UserError(error)
    return trackers


def epoch_audit(train_loader) -> dict[str, float]:
    """The epoch's data audit over every rank (``data.audit_summary``): every rank calls it, or
    none (--audit_data_every 0)."""
    if train_loader.audit is None:
        return {}
    return audit_summary(all_gather_objects(train_loader.audit_results()))


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """The epoch loop of one run: ``resume``, then ``fit``; the parts come from their rooms."""

    def __init__(self, cfg: TrainConfig, dist: DistInfo):
        # The flags as given: checkpoints keep them, so a restart can tell whether its own
        # flags change the run. ``self.cfg`` is the layout that makes the global batch here.
        self.requested, self.dist = cfg, dist
        # --max_time counts from here: loading and caching the data count too.
        self.budget = TimeBudget(parse_duration(cfg.max_time) if cfg.max_time else None)
        self.resume_from, cfg = find_resume(cfg, dist)
        self.cfg = cfg
        loaders = build_loaders(cfg, dist)
        self.train_loader, self.val_loader, self.sampler = (
            loaders.train,
            loaders.val,
            loaders.sampler,
        )
        self.class_names, self.decode_check = loaders.class_names, loaders.check
        self.steps_per_epoch = steps = len(self.train_loader)
        counts = loaders.class_counts
        self.parts = parts = build_run_parts(cfg, dist, len(self.class_names), steps, counts)
        # Built before the memory plan, so --auto_micro_batch's trials see its memory in use.
        self.ema = ModelEma(parts.plain_model if cfg.model_ema else None, cfg.ema_decay)
        # The micro-batch; with --auto_micro_batch found by trials (every rank takes part).
        parts.plan = build_memory_plan(
            cfg,
            TrialParts.of(parts),
            dist.processes_on_device,
            len(self.class_names),
            self.train_loader.dataset.source,
        )
        # The augmentation runs before the step, in the plan's chunks, retried like the step.
        self.train_loader.chunk = parts.plan.augment_chunk
        self.train_loader.retry_on_oom = parts.plan.retry_on_oom
        # --mixup/--cutmix: applied by the loop to each batch (None when both are off).
        self.mixer = loaders.mixer
        self.checkpoints = checkpoint_writer(cfg, dist.is_main)
        self.history = HistoryWriter(
            Path(cfg.log_dir) / "training_history.json",
            run_header(cfg, dist, self.class_names, parts, counts),
            enabled=dist.is_main,
            live=lambda: {"best": self.best.to_plain()},
        )
        # Every rank's host clocks, gathered with each stop agreement (none on one process).
        self.stragglers = (
            StragglerWatch(all_gather_objects(socket.gethostname()))
            if dist.is_distributed
            else None
        )
        self.stop = StopRequest(dist.is_distributed, self.stragglers)
        self.nonfinite = NonFiniteLoss(dist.device, dist.is_distributed)
        self.best = BestTracker(cfg)  # --best_metric, early stopping, the kept epochs
        # The best epoch's validation predictions, for the run's report.
        self.best_predictions = BestPredictions(Path(cfg.log_dir), self.class_names, dist.is_main)
        self.progress = Progress()
        self.checkpoint_written = False  # by this process: a --max_time stop may rely on it
        # --save_every_steps, --save_every_minutes: the checkpoints inside an epoch.
        self.saves = SaveSchedule(cfg.save_every_steps, cfg.save_every_minutes * 60)
        self.resumed_sums: torch.Tensor | None = None
        self.hooks = Hooks()  # registered by register_hooks, once the resumed position is known
        load = partial(load_optimisation, parts)
        self.run_state = RunState(
            parts, self.ema, self.best, self.history, self.class_names, cfg, self.requested, load
        )

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
            self.resume_from, self.run_state, self.dist, self.layout, self.steps_per_epoch
        )
        self.resume_from = None  # the weights are in the model now
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
            self.stop, self.step_done, self.save_checkpoint, steps, self.saves
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
            augmented_images=partial(augmented_images, self.train_loader),
        )  # fmt: skip
        return main_process_trackers(self.cfg, self.dist, context)

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(
        self, sums: torch.Tensor | None, is_best: bool = False, epoch_end: bool = False
    ) -> None:
        """Every rank must call this: each contributes its random state and running metrics.
        At an epoch's end (``epoch_end``) the epochs' checkpoints to keep are kept. Nothing is
        saved once the loss or the weights are no longer finite."""
        self.nonfinite.check(self.steps_per_epoch)
        heartbeat.mark(heartbeat.Phase.CHECKPOINT)
        started = self.budget.clock()
        rank_states = all_gather_objects(rank_state(sums, self.dist.device))
        keep = self.best.kept_epochs(self.history.records) if epoch_end else None
        state = checkpoint_state(self.run_state, self.progress, self.layout, rank_states)
        self.checkpoints.save_with_history(state, self.history, is_best, keep)
        self.saves.saved()
        self.checkpoint_written = True
        self.budget.timed_save(self.budget.clock() - started)

    # -- one epoch ------------------------------------------------------------------------
    def run_epoch(self) -> bool:
        """Train and evaluate one epoch; False if a stop signal ended it early."""
        # set_epoch reshuffles: without it every epoch would visit samples in the same order.
        self.sampler.set_epoch(self.epoch, position=self.position)
        first_step, started = self.step, time.perf_counter()
        self.budget.start_steps()
        progress = ProgressBar(self.dist.is_main, f"epoch {self.epoch + 1}/{self.cfg.epochs}")
        mixer = self.mixer.for_epoch(self.epoch) if self.mixer else None
        plan = EpochPlan(
            start_step=self.step,
            first_global_step=self.global_step,
            sums=self.resumed_sums,
            log_interval=self.cfg.log_interval,
            mixer=mixer,
            nonfinite=self.nonfinite,
            clock=self.stragglers.clock if self.stragglers else None,
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
        self.decode_check.finish()
        recorders = self.best_predictions.recorders(self.ema.enabled)
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
            self.best_predictions.keep(recorders, self.val_loader, record, self.best.state)
        self.save_checkpoint(None, is_best, epoch_end=True)
        self.hooks.call("on_epoch_end", self.epoch, record)
        note = best_note(self.best.state, self.ema.enabled) if is_best else ""
        log.info(epoch.line(self.cfg.epochs) + note)
        return True

    def validate_epoch(self, recorders: dict) -> dict[str, float]:
        """The epoch's validation metrics (``epoch_validation``), timed for --max_time."""
        started = self.budget.clock()
        heartbeat.mark(heartbeat.Phase.VALIDATION)
        val = epoch_validation(self.parts, self.ema, self.val_loader, self.dist, recorders)
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
            ranks=self.stragglers.epoch_figures() if self.stragglers else {},
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
        batches = len(self.val_loader) if validation else None
        return self.budget.too_short_for_next_stop(at_epoch_end, batches, steps_ahead)

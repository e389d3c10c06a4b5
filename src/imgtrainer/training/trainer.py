"""The Trainer: the state of one run and its per-epoch steps."""

from __future__ import annotations

import dataclasses
import logging
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import timm
import torch
import torchvision

from imgtrainer.checkpoints.files import load_training_checkpoint, training_checkpoint
from imgtrainer.checkpoints.resume import (
    apply_optimisation_settings,
    check_resume_fits,
    check_resume_settings,
    find_resume_checkpoint,
    optimisation_settings,
    rank_state,
    requested_global_batch,
    restore_rank_state,
    saved_global_batch,
    saved_world_size,
)
from imgtrainer.checkpoints.writer import CheckpointWriter
from imgtrainer.config import (
    Layout,
    TrainConfig,
    choose_layout,
    effective_batch,
    parse_duration,
)
from imgtrainer.data.balance import class_counts
from imgtrainer.data.loaders import build_loaders
from imgtrainer.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from imgtrainer.distributed.collectives import (
    all_gather_objects,
    broadcast_buffers,
    check_ranks_in_sync,
    peak_memory_mb,
)
from imgtrainer.distributed.setup import (
    DistInfo,
)
from imgtrainer.errors import RunFailed, UserError
from imgtrainer.hooks import Hook, Hooks, StepInfo
from imgtrainer.reports.history import HistoryWriter
from imgtrainer.reports.tensorboard import TensorBoardLogger
from imgtrainer.reports.trackers import TrackerContext, build_trackers
from imgtrainer.training.best import BestTracker
from imgtrainer.training.build import build_run_parts
from imgtrainer.training.ema import (
    EMA_SUFFIX,
    VAL_KEYS,
    ModelEma,
    ema_metrics,
)
from imgtrainer.training.evaluation import EvalSettings, evaluate
from imgtrainer.training.loop import EpochPlan, ProgressBar, train_one_epoch
from imgtrainer.training.memory_fit import TrialParts, build_memory_plan
from imgtrainer.training.mixing import BatchMixer
from imgtrainer.training.nonfinite import NonFiniteLoss
from imgtrainer.training.optim import restore_optimizer_state, restore_scheduler_state
from imgtrainer.training.stopping import StopRequest, TimeBudget

log = logging.getLogger(__name__)


def run_header(cfg: TrainConfig, dist: DistInfo, class_names: list[str]) -> dict[str, Any]:
    return {
        "config": cfg.to_dict(),
        "world_size": dist.world_size,
        "effective_batch_size": effective_batch(cfg, dist.world_size),
        "device": str(dist.device.type),
        "class_names": class_names,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "timm": timm.__version__,
        },
    }


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """The state of one run and the steps of its loop; ``main()`` below is its table of contents."""

    def __init__(self, cfg: TrainConfig, dist: DistInfo):
        # The flags as given: checkpoints keep them, so a restart can tell whether its own
        # flags change the run. ``self.cfg`` is the layout that makes the global batch here.
        self.requested, self.dist = cfg, dist
        # --max_time counts from here: loading and caching the data count too.
        self.budget = TimeBudget(parse_duration(cfg.max_time) if cfg.max_time else None)
        self.override_changes: list[str] = []  # the flags --resume_override applies
        self.resume_path, self.resume_state = self.find_resume_state(cfg, dist)
        self.cfg = cfg = self.lay_out(cfg)
        self.train_loader, self.val_loader, self.sampler, self.class_names = build_loaders(
            cfg, dist
        )
        self.steps_per_epoch = len(self.train_loader)
        self.parts = parts = build_run_parts(
            cfg,
            dist,
            len(self.class_names),
            self.steps_per_epoch,
            class_counts(self.train_loader.dataset.folder.targets, len(self.class_names)),
        )
        # Built before the memory plan, so --auto_micro_batch's trials see its memory in use.
        self.ema = ModelEma(parts.plain_model if cfg.model_ema else None, cfg.ema_decay)
        # The micro-batch; with --auto_micro_batch found by trials (every rank takes part).
        parts.plan = build_memory_plan(
            cfg, TrialParts.of(parts), dist.processes_on_device, len(self.class_names)
        )
        # --mixup/--cutmix: applied by the engine to each batch (None when both are off).
        self.mixer = BatchMixer.from_config(
            cfg, len(self.class_names), dist.rank, dist.device, dist.world_size
        )
        self.checkpoints = CheckpointWriter(
            Path(cfg.checkpoint_dir), enabled=dist.is_main, replace_previous_run=cfg.overwrite
        )
        self.history = HistoryWriter(
            Path(cfg.log_dir) / "training_history.json",
            run_header(cfg, dist, self.class_names),
            enabled=dist.is_main,
        )
        self.stop = StopRequest(dist.is_distributed)
        self.nonfinite = NonFiniteLoss(dist.device, dist.is_distributed)
        self.best = BestTracker(cfg)  # --best_metric, early stopping, the kept epochs
        self.epoch, self.step = 0, 0
        self.checkpoint_written = False  # by this process: a --max_time stop may rely on it
        self.resumed_sums: torch.Tensor | None = None
        self.hooks = Hooks()  # registered by register_hooks, once the resumed position is known

    # -- resume ---------------------------------------------------------------------------
    @staticmethod
    def find_resume_state(
        cfg: TrainConfig, dist: DistInfo
    ) -> tuple[Path | None, dict[str, Any] | None]:
        """The checkpoint to resume and its contents. Workers that torchrun restarted (an
        elastic restart, a lost process) continue from the newest checkpoint by themselves,
        as under --resume auto."""
        folder, path = Path(cfg.checkpoint_dir), None
        if not dist.first_attempt:
            path = find_resume_checkpoint("auto", folder)
        path = path or find_resume_checkpoint(cfg.resume, folder)
        return path, (load_training_checkpoint(path) if path is not None else None)

    @property
    def layout(self) -> Layout:
        return Layout(self.cfg.batch_size, self.cfg.accum_steps, self.dist.world_size)

    def lay_out(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` with the --batch_size and --accum_steps that make the resumed run's global
        batch on this run's processes (unchanged when its own flags make it). A resume whose
        flags change the global batch is refused here unless --resume_override."""
        state, world = self.resume_state, self.dist.world_size
        if state is None:
            return cfg
        # Model and optimizer first (the classes are compared once the data is read).
        check_resume_fits(
            state, self.resume_path, state.get("class_names"), cfg.model, cfg.optimizer
        )
        changes = check_resume_settings(
            state, self.resume_path, cfg.to_dict(), world, override=cfg.resume_override
        )
        self.override_changes = changes
        target, _ = requested_global_batch(state, cfg.to_dict(), world)
        if target == effective_batch(cfg, world):
            return cfg
        layout = choose_layout(target, world, cfg.batch_size)
        return replace(cfg, batch_size=layout.batch_size, accum_steps=layout.accum_steps)

    def resume(self) -> None:
        if self.resume_state is not None:
            self.load_checkpoint(self.resume_path, self.resume_state)
            self.resume_state = None  # the weights are in the model now
        # Only rank 0 writes checkpoints: a rank on another node that finds none (or another
        # one) would train other weights from another position, and hang at the epoch's end.
        positions = all_gather_objects((self.epoch, self.step))
        if len(set(positions)) > 1:
            raise UserError(
                f"the processes resume from different positions (epoch, step) "
                f"{positions}: --checkpoint_dir must be one folder that every node "
                "sees (a shared file system), or give --resume PATH on every node"
            )
        self.register_hooks()

    def register_hooks(self) -> None:
        """The per-step work, in the order it runs after each step. The EMA comes first: a
        checkpoint written at a step must hold the EMA of that step's weights. The logger
        continues from the resumed position (dropping what a crashed run wrote after it)."""
        if len(self.hooks):
            raise RuntimeError("the trainer's hooks are already registered")
        for hook in (
            self.ema,
            PositionKeeper(self),
            CheckpointAndStop(self),
            TensorBoardHook(self),
            *self.trackers(),
        ):
            self.hooks.register(hook)

    def trackers(self) -> list[Hook]:
        """--log_to's trackers, on the main process; a missing package or a refused login there
        stops every rank with its line."""
        trackers, error = [], None
        if self.dist.is_main:
            context = TrackerContext(
                self.cfg, Path(self.cfg.log_dir), self.global_step, self.steps_per_epoch
            )
            try:
                trackers = build_trackers(self.cfg.log_to, context)
            except UserError as err:
                error = str(err)
        error = all_gather_objects(error)[0]
        if error is not None:
            raise UserError(error)
        return trackers

    @property
    def global_step(self) -> int:
        """Optimizer steps since the run began: the step axis of the TensorBoard curves."""
        return self.epoch * self.steps_per_epoch + self.step

    def load_checkpoint(self, path: Path, ckpt: dict[str, Any]) -> None:
        parts = self.parts
        check_resume_fits(ckpt, path, self.class_names, self.cfg.model, self.cfg.optimizer)
        changes = self.override_changes
        from_flags = optimisation_settings(parts.optimizer, parts.scheduler)
        parts.plain_model.load_state_dict(ckpt["model_state_dict"])
        self.ema.resume(ckpt)
        # Param groups laid out otherwise (the flags that choose them changed) are matched by
        # name only under --resume_override.
        restore_optimizer_state(
            parts.optimizer, ckpt["optimizer_state_dict"], parts.plain_model, regroup=bool(changes)
        )
        restore_scheduler_state(parts.scheduler, ckpt["scheduler_state_dict"])
        if changes:  # --resume_override: the new values, over the loaded moments and step count
            apply_optimisation_settings(parts.optimizer, parts.scheduler, from_flags)
            log.info(
                f"--resume_override: applied {'; '.join(changes)}; learning rate now "
                f"{parts.optimizer.param_groups[0]['lr']:.3g}"
            )
        if ckpt.get("scaler_state_dict"):
            parts.scaler.load_state_dict(ckpt["scaler_state_dict"])
        self.epoch = ckpt["epoch"]
        self.step = self.resumed_position(ckpt) // effective_batch(self.cfg, self.dist.world_size)
        self.best.resume(ckpt, path, override=self.cfg.resume_override)
        # A micro-batch halved after an out-of-memory error stays halved.
        parts.plan.micro_batch = min(
            parts.plan.micro_batch, ckpt.get("micro_batch", parts.plan.micro_batch)
        )
        # The checkpoint's own history: records written after it (by the run that crashed)
        # are dropped, so every epoch appears exactly once.
        self.history.records = list(ckpt.get("history", []))
        self.history.save()
        self.resumed_sums = self.resumed_rank_state(ckpt)
        log.info(
            f"Resumed from {path}: epoch {self.epoch + 1}, step {self.step} of "
            f"{self.steps_per_epoch} (sample {self.step * self.layout.global_batch} of the "
            f"epoch's order), {self.best_line()}; processes "
            f"{saved_world_size(ckpt) or '?'} -> {self.dist.world_size}, layout "
            f"{self.layout.describe()}"
        )

    @staticmethod
    def resumed_position(ckpt: dict[str, Any]) -> int:
        """Samples of the epoch's global order consumed (older checkpoints count steps)."""
        if "epoch_position" in ckpt:
            return ckpt["epoch_position"]
        return ckpt.get("step", 0) * (saved_global_batch(ckpt) or 0)

    def resumed_rank_state(self, ckpt: dict[str, Any]) -> torch.Tensor | None:
        """This rank's random state and running metrics. Written by another number of
        processes, the metrics of the epoch's steps so far go to rank 0, as one sum (the epoch's
        figures are summed over ranks); the random streams are each rank's own, and nothing of
        the training draws from them (augmentation and mixing are seeded by position)."""
        rank_states = ckpt.get("rank_states") or []
        if len(rank_states) == self.dist.world_size:
            return restore_rank_state(rank_states[self.dist.rank], self.dist.device)
        sums = [s["train_sums"] for s in rank_states if s.get("train_sums") is not None]
        if not sums or not self.step or self.dist.rank != 0:
            return None
        return torch.stack(sums).sum(0)

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(
        self, sums: torch.Tensor | None, is_best: bool = False, epoch_end: bool = False
    ) -> None:
        """Every rank must call this: each contributes its random state and running metrics.
        At an epoch's end (``epoch_end``) the epochs' checkpoints to keep are kept. Nothing is
        saved once the loss or the weights are no longer finite."""
        self.nonfinite.check(self.steps_per_epoch)
        started = self.budget.clock()
        rank_states = all_gather_objects(rank_state(sums, self.dist.device))
        keep = self.best.kept_epochs(self.history.records) if epoch_end else None
        error = None
        try:
            # The checkpoint first: a resume rebuilds the history from it, so a failure between
            # the two loses nothing.
            self.checkpoints.save(self.checkpoint_state(rank_states), is_best, keep)
            self.history.save()
        except (UserError, RunFailed) as err:  # a full disk, or non-finite weights
            error = (isinstance(err, RunFailed), str(err))
        # Every rank stops with the main process's error line, instead of waiting for it at the
        # next collective.
        error = all_gather_objects(error)[0]
        if error is not None:
            failed, line = error
            raise RunFailed(line) if failed else UserError(line)
        self.checkpoint_written = True
        self.budget.timed_save(self.budget.clock() - started)

    def checkpoint_state(self, rank_states: list[dict[str, Any]]) -> dict[str, Any]:
        parts = self.parts
        weights = parts.plain_model.state_dict()
        ema_weights = self.ema.state_dict()
        return training_checkpoint(
            model_state_dict=weights,
            state_dict=weights,  # timm's key; the same dict, stored once
            model_ema_state_dict=ema_weights,
            state_dict_ema=ema_weights,  # timm's key; the same dict, stored once
            ema_updates=self.ema.updates if self.ema.enabled else None,
            best_weights=self.best.last_weights(self.history.records),
            optimizer_state_dict=parts.optimizer.state_dict(),
            scheduler_state_dict=parts.scheduler.state_dict(),
            scaler_state_dict=parts.scaler.state_dict() if parts.scaler.is_enabled() else None,
            epoch=self.epoch,
            step=self.step,
            # The position in the epoch's global sample order: a resume on any number of
            # processes continues there.
            epoch_position=self.step * self.layout.global_batch,
            layout=dataclasses.asdict(self.layout),
            micro_batch=parts.plan.micro_batch,
            **self.best.checkpoint_fields(self.history.records),
            class_names=self.class_names,
            image_size=self.cfg.image_size,
            mean=list(IMAGENET_MEAN),
            std=list(IMAGENET_STD),
            model_name=self.cfg.model,
            config=self.requested.to_dict(),
            world_size=self.dist.world_size,
            effective_batch_size=effective_batch(self.cfg, self.dist.world_size),
            history=self.history.records,
            rank_states=rank_states,
        )

    # -- one epoch ------------------------------------------------------------------------
    def run_epoch(self) -> bool:
        """Train and evaluate one epoch; False if a stop signal ended it early."""
        # set_epoch reshuffles: without it every epoch would visit samples in the same order.
        self.sampler.set_epoch(self.epoch, position=self.step * self.layout.global_batch)
        first_step, started = self.step, time.perf_counter()
        self.budget.start_steps()
        progress = ProgressBar(self.dist.is_main, f"epoch {self.epoch + 1}/{self.cfg.epochs}")
        train = train_one_epoch(
            self.parts,
            self.train_loader,
            hooks=self.hooks,
            progress=progress,
            epoch=EpochPlan(
                start_step=self.step,
                first_global_step=self.epoch * self.steps_per_epoch + self.step,
                sums=self.resumed_sums,
                log_interval=self.cfg.log_interval,
                mixer=self.mixer.for_epoch(self.epoch) if self.mixer else None,
                nonfinite=self.nonfinite,
            ),
        )
        self.resumed_sums = None
        if self.stop.requested_by_all:
            return False
        train_seconds = time.perf_counter() - started
        val = self.validate_epoch() if self.validates(self.epoch + 1) else {}
        if self.cfg.check_sync:
            check_ranks_in_sync(self.parts.plain_model)
            if self.ema.enabled:
                check_ranks_in_sync(self.ema.module)
        self.epoch, self.step = self.epoch + 1, 0
        # Speed counts the steps this process ran, not those restored from a checkpoint.
        images_per_sec = (
            (train["steps"] - first_step)
            * effective_batch(self.cfg, self.dist.world_size)
            / max(train_seconds, 1e-9)
        )
        self.history.append(self.epoch_record(train, val, images_per_sec, started))
        is_best = self.update_best(self.history.records[-1])
        self.save_checkpoint(None, is_best, epoch_end=True)
        self.hooks.call("on_epoch_end", self.epoch, self.history.records[-1])
        self.log_epoch(is_best)
        return True

    def validates(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (1-based) is validated: every --val_every_epochs-th, and the
        last."""
        return epoch % self.cfg.val_every_epochs == 0 or epoch == self.cfg.epochs

    def validate_epoch(self) -> dict[str, float]:
        """The epoch's validation metrics: the weights', and with EMA the average's."""
        started = self.budget.clock()
        val = self.validate(self.parts.plain_model)
        if self.ema.enabled:
            val.update(ema_metrics(self.validate(self.ema.module)))
        self.budget.timed_validation(self.budget.clock() - started)
        return val

    def update_best(self, record: dict[str, Any]) -> bool:
        """Count the epoch for the best checkpoint and early stopping; True if it is the new
        best. Every rank computes the same metrics, yet all take the main process's verdict, so
        they stop at the same epoch whatever the floating point does."""
        is_best = self.best.update(record)
        if self.dist.is_distributed:
            main_state, is_best = all_gather_objects((self.best.to_plain(), is_best))[0]
            self.best.from_plain(main_state)
        return is_best

    def validate(self, model: torch.nn.Module) -> dict[str, float]:
        """val_loss, val_acc, val_top5 of ``model`` (the trained weights or their EMA). Rank 0's
        BatchNorm statistics (the ones saved) go to every rank first. Every rank must call this."""
        broadcast_buffers(model)
        settings = EvalSettings(
            self.dist.device, self.parts.precision, self.parts.plan, self.dist.is_main
        )
        return evaluate(model, self.val_loader, settings)

    def epoch_record(
        self, train: dict, val: dict, images_per_sec: float, started: float
    ) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "train_loss": train["train_loss"],
            "train_acc": train["train_acc"],
            # An epoch without validation (--val_every_epochs) has none of the val_* keys.
            **{key: val[key] for key in VAL_KEYS if key in val},
            **{key: value for key, value in val.items() if key.endswith(EMA_SUFFIX)},
            "lr": self.parts.optimizer.param_groups[0]["lr"],
            "epoch_seconds": time.perf_counter() - started,
            "train_images_per_sec": images_per_sec,
            "peak_memory_mb": peak_memory_mb(self.dist.device),
            "micro_batch": self.parts.plan.micro_batch,
        }

    def log_epoch(self, is_best: bool) -> None:
        r = self.history.records[-1]
        log.info(
            f"epoch {r['epoch']}/{self.cfg.epochs}  train_loss {r['train_loss']:.4f}  "
            f"train_acc {r['train_acc']:.4f}  "
            + (
                f"val_loss {r['val_loss']:.4f}  val_acc {r['val_acc']:.4f}  "
                f"val_top5 {r['val_top5']:.4f}  "
                if "val_acc" in r
                else "(not validated)  "
            )
            + (
                f"val_loss_ema {r['val_loss_ema']:.4f}  val_acc_ema {r['val_acc_ema']:.4f}  "
                f"val_top5_ema {r['val_top5_ema']:.4f}  "
                if "val_acc_ema" in r
                else ""
            )
            + f"lr {r['lr']:.2e}  {r['train_images_per_sec']:.0f} img/s  "
            f"{r['epoch_seconds']:.1f}s" + (self.best_note(r) if is_best else "")
        )

    def best_note(self, record: dict[str, Any]) -> str:
        """Marks a best epoch on its log line; with EMA, says which weights scored it."""
        metric = "" if self.best.metric == "val_acc" else f" {self.best.metric}"
        if not self.ema.enabled:
            return f"  (best{metric})"
        weights = "EMA" if self.best.state.weights == "ema" else "raw"
        return f"  (best{metric}: {weights} weights)"

    def best_line(self) -> str:
        """The best so far, as "best val_acc 0.9123 (epoch 7)", or that there is none yet."""
        s = self.best.state
        if s.value is None:
            return f"no best {s.metric} yet"
        return f"best {s.metric} {s.value:.4f} (epoch {s.epoch})"

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

    def time_runs_out(self, at_epoch_end: bool) -> bool:
        """--max_time: whether the work up to the next point to stop at, and a checkpoint, no
        longer fit: after an epoch's last step its validation, else the next step."""
        if not self.budget.enabled:
            return False
        if not at_epoch_end:
            return self.budget.runs_out(self.budget.step_estimate())
        validation = (
            self.budget.validation_estimate(len(self.val_loader))
            if self.validates(self.epoch + 1)
            else 0.0
        )
        return self.budget.runs_out(validation)


# ----------------------------------------------------------------------------- per-step work


class PositionKeeper(Hook):
    """Keeps the trainer's position (for checkpoints and the stop message) after every step."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_step_end(self, info: StepInfo) -> bool:
        self.trainer.step = info.step
        return False


class TensorBoardHook(Hook):
    """The run's curves in TensorBoard (``reports.tensorboard.TensorBoardLogger``), on the main
    process unless --no_tensorboard; disabled elsewhere."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        # Resumed after step N (its events written before its checkpoint), the run's next
        # event is at N + 1: what a crashed run wrote from there on goes. A new run (N = 0)
        # replaces the folder's earlier events, as it replaces the history.
        start = trainer.global_step
        self.logger = TensorBoardLogger(
            Path(trainer.cfg.log_dir),
            enabled=trainer.dist.is_main and trainer.cfg.tensorboard,
            purge_step=start + 1 if start else 0,
        )
        self.enabled = self.logger.enabled  # a disabled logger makes no logging step read
        if self.enabled and trainer.global_step == 0:
            self.add_augmented_images()

    def add_augmented_images(self, count: int = 16) -> None:
        """What the model sees: the first training images of epoch 1, augmented as in training
        (the dataset draws each sample's augmentation from (seed, epoch, index))."""
        loader = self.trainer.train_loader
        keys = [(index, 0) for index in range(min(count, len(loader.dataset)))]
        augment = loader.augment
        self.logger.add_image_grid(loader.preview(keys), mean=augment.mean, std=augment.std)

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        self.logger.add_step_metrics(
            global_step,
            {
                "loss": metrics["train_loss"],
                "acc": metrics["train_acc"],
                "lr": metrics["lr"],
                "images_per_sec": metrics["images_per_sec"],
                "data_wait_share": metrics["data_wait_share"],
            },
        )

    def on_epoch_end(self, epoch: int, record: dict) -> None:
        # At the global step where the epoch ended: one step axis for every series.
        self.logger.add_epoch_record(epoch * self.trainer.steps_per_epoch, record)

    def on_run_end(self, hparams: dict, final_metrics: dict) -> None:
        self.logger.add_run_end(self.trainer.global_step, hparams, final_metrics)

    def close(self) -> None:
        self.logger.close()


class CheckpointAndStop(Hook):
    """The agreed stop on a signal or the --max_time budget (with a checkpoint), and the
    periodic checkpoint of --save_every_steps. Every rank runs it: both are collectives; only
    the main process writes (its CheckpointWriter)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.every = trainer.cfg.save_every_steps

    def on_step_end(self, info: StepInfo) -> bool:
        trainer = self.trainer
        trainer.budget.step_done()
        time_up = trainer.time_runs_out(at_epoch_end=info.step == trainer.steps_per_epoch)
        if trainer.stop.agreed(time_up):
            trainer.save_checkpoint(info.sums)
            return True
        if self.every and info.step % self.every == 0 and info.step < trainer.steps_per_epoch:
            trainer.save_checkpoint(info.sums)
        return False

"""The Trainer: the state of one run and its per-epoch steps."""

from __future__ import annotations

import logging
import platform
import time
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
    restore_rank_state,
    saved_step_batch,
)
from imgtrainer.checkpoints.writer import CheckpointWriter
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
from imgtrainer.errors import UserError
from imgtrainer.reports.history import HistoryWriter
from imgtrainer.reports.tensorboard import TensorBoardLogger
from imgtrainer.run.config import (
    TrainConfig,
    effective_batch,
    optimizer_batch,
)
from imgtrainer.run.lifecycle import mark
from imgtrainer.training.build import build_run_parts
from imgtrainer.training.ema import (
    EMA_SUFFIX,
    ModelEma,
    better_weights,
    ema_metrics,
    epoch_score,
    weights_label,
)
from imgtrainer.training.evaluation import EvalSettings, evaluate
from imgtrainer.training.hooks import Hook, Hooks
from imgtrainer.training.loop import EpochPlan, ProgressBar, train_one_epoch
from imgtrainer.training.memory_fit import TrialParts, build_memory_plan
from imgtrainer.training.mixing import BatchMixer
from imgtrainer.training.optim import restore_optimizer_state, restore_scheduler_state
from imgtrainer.training.step import StepInfo
from imgtrainer.training.stopping import StopRequest

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
        self.cfg, self.dist = cfg, dist
        self.train_loader, self.val_loader, self.sampler, self.class_names = build_loaders(
            cfg, dist
        )
        self.steps_per_epoch = len(self.train_loader)
        self.parts = parts = build_run_parts(cfg, dist, len(self.class_names), self.steps_per_epoch)
        # Built before the memory plan, so --auto_micro_batch's trials see its memory in use.
        self.ema = ModelEma(parts.plain_model if cfg.model_ema else None, cfg.ema_decay)
        # The micro-batch; with --auto_micro_batch found by trials (every rank takes part).
        parts.plan = build_memory_plan(
            cfg, TrialParts.of(parts), dist.local_world_size, len(self.class_names)
        )
        # --mixup/--cutmix: applied by the engine to each batch (None when both are off).
        self.mixer = BatchMixer.from_config(cfg, len(self.class_names), dist.rank, dist.device)
        self.checkpoints = CheckpointWriter(
            Path(cfg.checkpoint_dir), enabled=dist.is_main, replace_previous_run=cfg.overwrite
        )
        self.history = HistoryWriter(
            Path(cfg.log_dir) / "training_history.json",
            run_header(cfg, dist, self.class_names),
            enabled=dist.is_main,
        )
        self.stop = StopRequest(dist.is_distributed)
        self.epoch, self.step, self.best_acc = 0, 0, 0.0
        self.resumed_sums: torch.Tensor | None = None
        self.hooks = Hooks()  # registered by register_hooks, once the resumed position is known

    # -- resume ---------------------------------------------------------------------------
    def resume(self) -> None:
        path = find_resume_checkpoint(self.cfg.resume, Path(self.cfg.checkpoint_dir))
        if path is not None:
            self.load_checkpoint(path)
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
        ):
            self.hooks.register(hook)

    @property
    def global_step(self) -> int:
        """Optimizer steps since the run began: the step axis of the TensorBoard curves."""
        return self.epoch * self.steps_per_epoch + self.step

    def load_checkpoint(self, path: Path) -> None:
        parts = self.parts
        ckpt = load_training_checkpoint(path)
        check_resume_fits(ckpt, path, self.class_names, self.cfg.model, self.cfg.optimizer)
        changes = check_resume_settings(
            ckpt, path, self.cfg.to_dict(), self.dist.world_size, override=self.cfg.resume_override
        )
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
        self.epoch, self.step = ckpt["epoch"], ckpt.get("step", 0)
        self.best_acc = ckpt.get("best_acc", 0.0)
        # A micro-batch halved after an out-of-memory error stays halved.
        parts.plan.micro_batch = min(
            parts.plan.micro_batch, ckpt.get("micro_batch", parts.plan.micro_batch)
        )
        # The checkpoint's own history: records written after it (by the run that crashed)
        # are dropped, so every epoch appears exactly once.
        self.history.records = list(ckpt.get("history", []))
        self.history.save()
        rank_states = ckpt.get("rank_states") or []
        # The position within the epoch counts loader batches of one optimizer step each.
        saved_step = saved_step_batch(ckpt)
        same_layout = (
            len(rank_states) == self.dist.world_size
            and saved_step is not None
            and saved_step[0] * saved_step[1] == optimizer_batch(self.cfg)
        )
        if same_layout:
            self.resumed_sums = restore_rank_state(rank_states[self.dist.rank], self.dist.device)
        elif self.step:
            per_process = (
                f"{saved_step[0] * saved_step[1]}" if saved_step else "an unknown number of"
            )
            log.warning(
                f"{path} was written by {len(rank_states)} process(es) with "
                f"{per_process} images per optimizer step each; with a different "
                f"layout, epoch {self.epoch + 1} restarts from its first step"
            )
            self.step = 0
        log.info(
            f"Resumed from {path}: epoch {self.epoch + 1}, step {self.step} of "
            f"{self.steps_per_epoch}, best val_acc {self.best_acc:.4f}"
        )

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, sums: torch.Tensor | None, is_best: bool = False) -> None:
        """Every rank must call this: each contributes its random state and running metrics."""
        rank_states = all_gather_objects(rank_state(sums, self.dist.device))
        error = None
        try:
            # The checkpoint first: a resume rebuilds the history from it, so a failure between
            # the two loses nothing.
            self.checkpoints.save(self.checkpoint_state(rank_states), is_best)
            self.history.save()
        except UserError as err:  # a full disk on the main process
            error = str(err)
        # Every rank stops with the main process's error line, instead of waiting for it at the
        # next collective.
        error = all_gather_objects(error)[0]
        if error is not None:
            raise UserError(error)

    def checkpoint_state(self, rank_states: list[dict[str, Any]]) -> dict[str, Any]:
        parts = self.parts
        weights = parts.plain_model.state_dict()
        ema_weights = self.ema.state_dict()
        last = self.history.records[-1] if self.history.records else None
        return training_checkpoint(
            model_state_dict=weights,
            state_dict=weights,  # timm's key; the same dict, stored once
            model_ema_state_dict=ema_weights,
            state_dict_ema=ema_weights,  # timm's key; the same dict, stored once
            ema_updates=self.ema.updates if self.ema.enabled else None,
            best_weights=better_weights(last, self.ema.enabled) if last else None,
            optimizer_state_dict=parts.optimizer.state_dict(),
            scheduler_state_dict=parts.scheduler.state_dict(),
            scaler_state_dict=parts.scaler.state_dict() if parts.scaler.is_enabled() else None,
            epoch=self.epoch,
            step=self.step,
            micro_batch=parts.plan.micro_batch,
            best_acc=self.best_acc,
            class_names=self.class_names,
            image_size=self.cfg.image_size,
            mean=list(IMAGENET_MEAN),
            std=list(IMAGENET_STD),
            model_name=self.cfg.model,
            config=self.cfg.to_dict(),
            world_size=self.dist.world_size,
            effective_batch_size=effective_batch(self.cfg, self.dist.world_size),
            history=self.history.records,
            rank_states=rank_states,
        )

    # -- one epoch ------------------------------------------------------------------------
    def run_epoch(self) -> bool:
        """Train and evaluate one epoch; False if a stop signal ended it early."""
        # set_epoch reshuffles: without it every epoch would visit samples in the same order.
        self.sampler.set_epoch(self.epoch, start=self.step * optimizer_batch(self.cfg))
        first_step, started = self.step, time.perf_counter()
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
            ),
        )
        self.resumed_sums = None
        if self.stop.requested_by_all:
            return False
        train_seconds = time.perf_counter() - started
        val = self.validate(self.parts.plain_model)
        if self.ema.enabled:
            val.update(ema_metrics(self.validate(self.ema.module)))
        if self.cfg.check_sync:
            check_ranks_in_sync(self.parts.plain_model)
            if self.ema.enabled:
                check_ranks_in_sync(self.ema.module)
        self.epoch, self.step = self.epoch + 1, 0
        # With EMA, the better of the two sets of weights counts; the checkpoint says which.
        score = epoch_score(val)
        is_best = score > self.best_acc
        self.best_acc = max(self.best_acc, score)
        # Speed counts the steps this process ran, not those restored from a checkpoint.
        images_per_sec = (
            (train["steps"] - first_step)
            * effective_batch(self.cfg, self.dist.world_size)
            / max(train_seconds, 1e-9)
        )
        self.history.append(self.epoch_record(train, val, images_per_sec, started))
        self.save_checkpoint(None, is_best)
        self.hooks.call("on_epoch_end", self.epoch, self.history.records[-1])
        self.log_epoch(is_best)
        return True

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
            "val_loss": val["val_loss"],
            "val_acc": val["val_acc"],
            "val_top5": val["val_top5"],
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
            f"train_acc {r['train_acc']:.4f}  val_loss {r['val_loss']:.4f}  "
            f"val_acc {r['val_acc']:.4f}  val_top5 {r['val_top5']:.4f}  "
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
        return f"  (best: {weights_label(record)} weights)" if self.ema.enabled else "  (best)"

    def end_hooks(self, finished: bool) -> None:
        """A finished run's hyperparameters and final metrics, for the loggers among the hooks."""
        if finished and self.history.records:
            self.hooks.call("on_run_end", self.cfg.to_dict(), self.history.records[-1])

    def fit(self) -> bool:
        """Train until the last epoch, or until a stop signal; True if the run finished."""
        while self.epoch < self.cfg.epochs:
            # A signal that arrived during evaluation is honoured here, at an epoch boundary
            # whose checkpoint is already written.
            if self.stop.agreed() or not self.run_epoch():
                return False
        return True


# ----------------------------------------------------------------------------- per-step work


class PositionKeeper(Hook):
    """Keeps the trainer's position (for checkpoints and the stop message) after every step."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_step_end(self, info: StepInfo) -> bool:
        self.trainer.step = info.step
        mark("first step done", once=True)
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
    """The agreed stop on a signal (with a checkpoint), and the periodic checkpoint of
    --save_every_steps. Every rank runs it: both are collectives; only the main process
    writes (its CheckpointWriter)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.every = trainer.cfg.save_every_steps

    def on_step_end(self, info: StepInfo) -> bool:
        trainer = self.trainer
        if trainer.stop.agreed():
            trainer.save_checkpoint(info.sums)
            return True
        if self.every and info.step % self.every == 0 and info.step < trainer.steps_per_epoch:
            trainer.save_checkpoint(info.sums)
        return False

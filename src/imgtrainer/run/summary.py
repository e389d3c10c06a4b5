"""The lines that open and close a run's log."""

from __future__ import annotations

import dataclasses
import logging
import signal
from pathlib import Path

import torch

from imgtrainer.checkpoints.run_folder import epoch_checkpoints
from imgtrainer.config import Layout, TrainConfig
from imgtrainer.distributed.setup import (
    DistInfo,
)
from imgtrainer.errors import first_line
from imgtrainer.events import event
from imgtrainer.reports.history import best_line
from imgtrainer.reports.page.run_report import report_line, write_run_report
from imgtrainer.training.trainer import Trainer

log = logging.getLogger(__name__)


def log_run_start(cfg: TrainConfig, dist: DistInfo, trainer: Trainer) -> None:
    classes, threads = len(trainer.loaders.class_names), torch.get_num_threads()
    train, val = len(trainer.train_loader.dataset), len(trainer.loaders.val.dataset)
    # The model, processes and device are the history's head already.
    facts = event("training", train_images=train, val_images=val, threads=threads)
    log.info(
        f"Training {cfg.model} on {classes} classes, {train} train / {val} val images, world "
        f"size {dist.world_size} on {dist.device.type}, {threads} thread(s) per process, "
        f"{trainer.train_loader.num_workers} loader worker(s) per process",
        extra=facts,
    )
    layout = Layout.of(cfg, dist.world_size)
    log.info(
        f"Effective batch: {layout.describe()} images per optimizer step",
        extra=event("batch", global_batch=layout.global_batch, **dataclasses.asdict(layout)),
    )
    if dist.preflight is not None:
        log.info(dist.preflight.line)
        if dist.preflight.warning:
            log.warning(
                "NCCL or driver versions differ between hosts, a known cause of NCCL hangs: "
                + dist.preflight.warning
            )
    log.info("Config: " + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items()))


def log_summary(trainer: Trainer, finished: bool) -> None:
    """Why the run ended, its best epoch and the files it wrote (or the command that resumes)."""
    cfg, saved = trainer.cfg, trainer.checkpoints
    mirror = saved.mirror
    latest, best = (mirror.target(p.name) for p in (saved.latest, saved.best)) if mirror else (
        saved.latest,
        saved.best,
    )  # fmt: skip
    if not finished:
        budget = (
            f" (the --max_time budget {cfg.max_time} is nearly spent)"
            if trainer.stop.by_time
            else ""
        )
        signum, reason = trainer.stop.signum, "max_time" if trainer.stop.by_time else "signal"
        by = {"signal": signal.Signals(signum).name} if signum and reason == "signal" else {}
        log.info(
            f"Stopped at epoch {trainer.epoch + 1}, step {trainer.step}{budget}; checkpoint "
            f"saved to {latest}. Resume with the same command plus "
            f"--resume {'auto' if mirror else latest}",
            extra=ending(trainer, "stop", reason=reason, finished=False, **by),
        )
        return
    history = Path(cfg.log_dir) / "training_history.json"
    kept = epoch_checkpoints(trainer.checkpoints.dir) if trainer.dist.is_main else {}
    early = {"reason": "early_stopping"} if trainer.stopped_early else {}
    log.info(
        f"{ending_line(trainer)}\n"
        f"  best checkpoint:   {best}\n"
        f"  latest checkpoint: {latest}\n"
        + (
            f"  kept epochs:       {', '.join(str(epoch) for epoch in kept)} "
            f"({mirror.url if mirror else saved.dir}/checkpoint_epoch_NNN.pth)\n"
            if kept
            else ""
        )
        + f"  history:           {history}\n"
        f"  plot the curves:   python src/utils.py --history {history} --output curves.png",
        extra=ending(trainer, "stop" if early else "done", finished=True, **early),
    )


def ending(trainer: Trainer, kind: str, **fields) -> dict:
    """The event of how the run ended ("done", or "stop" and its reason), at which position."""
    return event(kind, epoch=trainer.epoch, step=trainer.step, **fields)


def ending_line(trainer: Trainer) -> str:
    """Why a finished run ended (its last epoch, or early stopping) and its best epoch."""
    cfg = trainer.cfg
    if not trainer.stopped_early:
        return f"Done: {best_summary(trainer)}; {trainer.epoch} epochs trained"
    delta = cfg.early_stopping_min_delta
    return (
        f"Stopped early after epoch {trainer.epoch} of {cfg.epochs}: {cfg.best_metric} did not "
        f"improve{f' by more than {delta:g}' if delta else ''} in "
        f"{trainer.best.state.wait} validated epochs (--early_stopping_patience "
        f"{cfg.early_stopping_patience}); {best_summary(trainer)}"
    )


def best_summary(trainer: Trainer) -> str:
    """The best epoch, as "best val_acc 0.9123 (epoch 7)"; with EMA "(EMA weights, epoch 7)"."""
    none = "no epoch was validated, so no best {metric}"
    return best_line(trainer.best.state, trainer.ema.enabled, none=none)


def write_report(cfg: TrainConfig, dist: DistInfo) -> None:
    """<log_dir>/report.html, from the files the run wrote, by the main process once the run
    has ended however it ended; a failure to write it is a warning, never the run's."""
    if not dist.is_main:
        return
    try:
        path, size, seconds = write_run_report(Path(cfg.log_dir))
    except Exception as err:  # the report must not turn a finished run into a failed one
        log.warning(
            f"the run's report was not written ({first_line(err)}); "
            f"python src/utils.py --report {cfg.log_dir} tries again"
        )
        return
    log.info(report_line(path, size, seconds))

"""The lines that open and close a run's log."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from imgtrainer.distributed.setup import (
    DistInfo,
)
from imgtrainer.run.config import (
    TrainConfig,
    effective_batch_line,
)
from imgtrainer.training.ema import (
    best_record,
    weights_label,
)
from imgtrainer.training.trainer import Trainer

log = logging.getLogger(__name__)


def log_run_start(cfg: TrainConfig, dist: DistInfo, trainer: Trainer) -> None:
    log.info(
        f"Training {cfg.model} on {len(trainer.class_names)} classes, "
        f"{len(trainer.train_loader.dataset)} train / "
        f"{len(trainer.val_loader.dataset)} val images, world size {dist.world_size} "
        f"on {dist.device.type}, {torch.get_num_threads()} thread(s) per process, "
        f"{trainer.train_loader.num_workers} loader worker(s) per process"
    )
    log.info(effective_batch_line(cfg, dist.world_size))
    log.info("Config: " + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items()))


def log_summary(trainer: Trainer, finished: bool) -> None:
    cfg = trainer.cfg
    if not finished:
        log.info(
            f"Stopped at epoch {trainer.epoch + 1}, step {trainer.step}; checkpoint saved "
            f"to {trainer.checkpoints.latest}. Resume with the same command plus "
            f"--resume {trainer.checkpoints.latest}"
        )
        return
    history = Path(cfg.log_dir) / "training_history.json"
    # With EMA: which weights of which epoch checkpoint_best.pth holds the score of.
    best = best_record(trainer.history.records) if trainer.ema.enabled else None
    which = f" ({weights_label(best)} weights, epoch {best['epoch']})" if best else ""
    log.info(
        f"Done: best val_acc {trainer.best_acc:.4f}{which}\n"
        f"  best checkpoint:   {trainer.checkpoints.best}\n"
        f"  latest checkpoint: {trainer.checkpoints.latest}\n"
        f"  history:           {history}\n"
        f"  plot the curves:   python src/utils.py --history {history} --output curves.png"
    )

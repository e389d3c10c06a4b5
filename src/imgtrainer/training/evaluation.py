"""Evaluation: exact loss and top-1/top-5 summed over every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from imgtrainer import heartbeat
from imgtrainer.config import TrainConfig
from imgtrainer.distributed.collectives import all_reduce_sum, broadcast_buffers
from imgtrainer.distributed.logs import console_is_terminal
from imgtrainer.distributed.setup import DistInfo
from imgtrainer.precision import Precision
from imgtrainer.training.ema import ModelEma, ema_metrics
from imgtrainer.training.memory import MemoryPlan
from imgtrainer.training.step import (
    CORRECT,
    COUNT,
    LOSS,
    TOP5,
    PredictionHook,
    RunParts,
    to_device,
)


@dataclass(frozen=True)
class EvalSettings:
    """Where and how evaluation runs: the device, AMP, and the micro-batches of the memory plan."""

    device: torch.device
    precision: Precision
    plan: MemoryPlan | None = None
    show_progress: bool = True


def evaluate(
    model: nn.Module,
    loader,
    settings: EvalSettings,
    on_predictions: PredictionHook | None = None,
) -> dict[str, float]:
    """Loss, top-1 and top-5 over this rank's shard, summed over all ranks; loaded batches go
    through the model in ``plan``'s micro-batches, as in training. ``on_predictions`` sees every
    prediction (src/evaluate.py's report is built from this same pass, so it matches the
    ``val_acc`` recorded in training).

    Every rank must call this (the final all-reduce is a collective). Shards are uneven by at
    most one image, which is fine: ``model`` is the unwrapped module, so the forward passes run
    no collectives and no rank waits for another inside the loop.
    """
    total = evaluation_sums(model, loader, settings, on_predictions).tolist()
    count = max(total[COUNT], 1)
    return {
        "val_loss": total[LOSS] / count,
        "val_acc": total[CORRECT] / count,
        "val_top5": total[TOP5] / count,
        "val_samples": int(total[COUNT]),
    }


@torch.no_grad()
def evaluation_sums(
    model: nn.Module,
    loader,
    settings: EvalSettings,
    on_predictions: PredictionHook | None = None,
) -> torch.Tensor:
    """``evaluate``'s pass: [loss_sum, correct, count, top5_correct] summed over all ranks, as
    float64 on the device. Every rank must call this."""
    model.eval()
    device, precision = settings.device, settings.precision
    plan = settings.plan or MemoryPlan()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    # No bar where the console is not a terminal: its redraws would pile up on one line.
    show = settings.show_progress and console_is_terminal()
    for batch_images, batch_targets in tqdm(
        loader, desc="val", disable=not show, dynamic_ncols=True, leave=False
    ):
        heartbeat.tick()  # shards differ by a batch at most: a tick, not a beat
        size = plan.size_for(len(batch_targets))
        for x, y in zip(batch_images.split(size), batch_targets.split(size), strict=True):
            images, targets = to_device(x, y, device, plan.channels_last)
            with precision.autocast(device):
                logits = model(images)
            k = min(5, logits.size(1))
            top = logits.topk(k, dim=1).indices
            sums[LOSS] += F.cross_entropy(logits.float(), targets, reduction="sum").double()
            sums[CORRECT] += (top[:, 0] == targets).sum()
            sums[TOP5] += (top == targets[:, None]).any(dim=1).sum()
            sums[COUNT] += targets.size(0)
            if on_predictions is not None:
                on_predictions(logits.float(), top[:, 0], targets)
    return all_reduce_sum(sums)


def is_validation_epoch(cfg: TrainConfig, epoch: int) -> bool:
    """Whether epoch ``epoch`` (1-based) is validated: every --val_every_epochs-th, and the
    last."""
    return epoch % cfg.val_every_epochs == 0 or epoch == cfg.epochs


def validation_metrics(
    model: nn.Module,
    loader,
    parts: RunParts,
    dist: DistInfo,
    on_predictions: PredictionHook | None = None,
) -> dict[str, float]:
    """val_loss, val_acc, val_top5 of ``model`` (the trained weights or their EMA). Rank 0's
    BatchNorm statistics (the ones saved) go to every rank first. Every rank must call this."""
    broadcast_buffers(model)
    settings = EvalSettings(dist.device, parts.precision, parts.plan, dist.is_main)
    return evaluate(model, loader, settings, on_predictions)


def epoch_validation(
    parts: RunParts,
    ema: ModelEma,
    loader,
    dist: DistInfo,
    recorders: dict[str, PredictionHook] | None = None,
) -> dict[str, float]:
    """An epoch's validation metrics: the weights', and with EMA the average's; ``recorders``
    (by "raw" and "ema") see each one's predictions."""
    recorders = recorders or {}
    val = validation_metrics(parts.plain_model, loader, parts, dist, recorders.get("raw"))
    if ema.enabled:
        ema_val = validation_metrics(ema.module, loader, parts, dist, recorders.get("ema"))
        val.update(ema_metrics(ema_val))
    return val

"""A run's parts, built in one place from the config: model (with memory savers and wrappers),
optimizer, scheduler, precision, GradScaler and loss. The trainer and the benchmarks use it.
"""

from __future__ import annotations

import platform
import random
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from imgtrainer import torch_compat
from imgtrainer.config import TrainConfig
from imgtrainer.distributed.setup import DistInfo
from imgtrainer.errors import UserError
from imgtrainer.models import build_model, unwrap_model
from imgtrainer.precision import choose_precision, make_grad_scaler, uses_channels_last
from imgtrainer.training.loss import build_criterion
from imgtrainer.training.memory import MemoryPlan, enable_memory_savers
from imgtrainer.training.optim import build_optimizer, build_scheduler
from imgtrainer.training.step import RunParts


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def wrap_model(model: nn.Module, cfg: TrainConfig, dist: DistInfo) -> nn.Module:
    """Device placement, then DDP, then torch.compile; ``unwrap_model`` undoes the wrappers."""
    model = model.to(dist.device)
    if dist.is_distributed:
        if cfg.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        device_ids = [dist.device.index] if dist.device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy, less
        # memory). broadcast_buffers=False: no collective at every forward; BatchNorm uses batch
        # statistics in training, and rank 0's running statistics (the ones saved) are the
        # same either way; broadcast_buffers() hands them to every rank before evaluation.
        model = DDP(
            model,
            device_ids=device_ids,
            gradient_as_bucket_view=True,
            **torch_compat.no_forward_buffer_sync(),
        )
    if cfg.compile:
        model = compile_model(model)
    return model


def compile_model(model: nn.Module) -> nn.Module:
    if not torch_compat.dynamo_supported():
        raise UserError(
            f"--compile: torch.compile is not supported with Python "
            f"{platform.python_version()} and torch {torch.__version__}; "
            "run without --compile"
        )
    return torch.compile(model)


def build_run_parts(
    cfg: TrainConfig,
    dist: DistInfo,
    num_classes: int,
    steps_per_epoch: int,
    class_counts: Sequence[int] | None = None,
) -> RunParts:
    """Every part of a run that depends only on the config, the ranks and the data's shape
    (``class_counts``: training images per class, which --class_weights reads)."""
    # Every rank builds the same initial weights (DDP would broadcast rank 0's anyway).
    seed_everything(cfg.seed)
    model = build_model(cfg.model, num_classes, cfg.pretrained, cfg.pretrained_path)
    enable_memory_savers(
        model,
        grad_checkpointing=cfg.grad_checkpointing,
        channels_last=uses_channels_last(cfg.channels_last, dist.device),
        early_only=cfg.low_memory,
    )
    wrapped = wrap_model(model, cfg, dist)
    # From here each rank draws different random numbers (dropout, drop-path): offset by rank.
    seed_everything(cfg.seed + dist.rank)
    optimizer = build_optimizer(cfg, wrapped, dist.world_size)
    precision = choose_precision(cfg, dist.device)
    return RunParts(
        model=wrapped,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg, optimizer, steps_per_epoch),
        scaler=make_grad_scaler(precision, dist.device),
        criterion=build_criterion(cfg, class_counts).to(dist.device),
        precision=precision,
        plan=MemoryPlan(),  # the trainer replaces it with the one that fits (memory_fit)
        device=dist.device,
        clip_grad_norm=cfg.clip_grad_norm,
        plain_model=unwrap_model(wrapped),
    )

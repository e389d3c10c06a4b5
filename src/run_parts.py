"""A run's parts, built in one place from the config: the model (with its memory savers and
wrappers), optimizer, scheduler, precision, GradScaler and loss.

The trainer and both benchmarks (bench/throughput.py, bench/memory.py) build them here, so the
figures the benchmarks print are those of the trainer's own set-up, flags included.
"""

from __future__ import annotations

import inspect
import logging
import platform
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from config import TrainConfig
from distributed import DistInfo
from engine import Precision, StepState
from errors import UserError
from memory import MemoryPlan, enable_memory_savers
from model import build_model, unwrap_model
from optim import build_optimizer, build_scheduler

log = logging.getLogger(f"trainer.{__name__}")  # under the project logger


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def choose_precision(cfg: TrainConfig, device: torch.device) -> Precision:
    if not cfg.use_amp:
        return Precision(False, torch.float32)
    if device.type == "cpu" and cfg.low_memory:
        # bfloat16 autocast runs ~16x slower than float32 on the CPU, and the micro-batches
        # already keep the memory within the budget.
        log.info(
            "--low_memory on the CPU: training in float32 (bfloat16 autocast is much slower there)"
        )
        return Precision(False, torch.float32)
    if device.type == "cpu":
        log.warning(
            "--use_amp on the CPU uses bfloat16 autocast, which is usually "
            "slower than float32 there"
        )
        return Precision(True, torch.bfloat16)
    return Precision(True, getattr(torch, cfg.amp_dtype))


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
            model, device_ids=device_ids, gradient_as_bucket_view=True, **no_forward_buffer_sync()
        )
    if cfg.compile:
        model = compile_model(model)
    return model


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's switch for "no buffer broadcast at every forward": torch 2.14 renamed
    ``broadcast_buffers`` to ``forward_sync_buffers`` and warns at every use of the old name;
    older releases (down to the 2.3 that requirements.txt allows) know only the old one."""
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def compile_model(model: nn.Module) -> nn.Module:
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise UserError(
            f"--compile: torch.compile is not supported with Python "
            f"{platform.python_version()} and torch {torch.__version__}; "
            "run without --compile"
        )
    return torch.compile(model)


def make_grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling is needed for float16 only: bfloat16 has float32's exponent range."""
    return torch.amp.GradScaler(
        device.type, enabled=precision.enabled and precision.dtype == torch.float16
    )


@dataclass
class RunParts:
    """What one training step needs, and the unwrapped model (what checkpoints save)."""

    model: nn.Module  # wrapped: DDP and/or compiled, on the device
    plain_model: nn.Module  # the same weights, unwrapped
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    precision: Precision
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    device: torch.device
    clip_grad_norm: float = 0.0  # 0: off

    def step_state(self, plan: MemoryPlan | None = None) -> StepState:
        return StepState(
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.criterion,
            self.precision,
            plan or MemoryPlan(),
            self.device,
            clip_grad_norm=self.clip_grad_norm,
        )


def build_run_parts(
    cfg: TrainConfig, dist: DistInfo, num_classes: int, steps_per_epoch: int
) -> RunParts:
    """Every part of a run that depends only on the config, the ranks and the data's shape."""
    # Every rank builds the same initial weights (DDP would broadcast rank 0's anyway).
    seed_everything(cfg.seed)
    model = build_model(cfg.model, num_classes, cfg.pretrained, cfg.pretrained_path)
    enable_memory_savers(
        model,
        grad_checkpointing=cfg.grad_checkpointing,
        channels_last=cfg.channels_last and dist.device.type == "cuda",
    )
    wrapped = wrap_model(model, cfg, dist)
    # From here each rank draws different random numbers (dropout, drop-path): offset by rank.
    seed_everything(cfg.seed + dist.rank)
    optimizer = build_optimizer(cfg, wrapped, dist.world_size)
    precision = choose_precision(cfg, dist.device)
    return RunParts(
        model=wrapped,
        plain_model=unwrap_model(wrapped),
        optimizer=optimizer,
        scheduler=build_scheduler(cfg, optimizer, steps_per_epoch),
        precision=precision,
        scaler=make_grad_scaler(precision, dist.device),
        criterion=nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing),
        device=dist.device,
        clip_grad_norm=cfg.clip_grad_norm,
    )

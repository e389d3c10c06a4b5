"""The optimizer, its learning-rate schedule, and its state across runs: a resumed optimizer
runs with this run's own kernels and its parameters' device, dtype and memory layout, whatever
the checkpoint was written with."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from config import TrainConfig

# Param-group options that choose how the update runs, not what it computes: they belong to
# the run (its device, its precision), not to the checkpoint.
IMPLEMENTATION_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def lr_scale(lr_scaling: str, accum_steps: int, world_size: int) -> float:
    """The factor of --lr_scaling: the effective batch (batch_size x accum_steps x world size)
    over the batch of one pass in one process (batch_size), R = accum_steps x world size;
    linear: R, sqrt: sqrt(R)."""
    ratio = accum_steps * world_size
    return {"none": 1.0, "linear": float(ratio), "sqrt": math.sqrt(ratio)}[lr_scaling]


def build_optimizer(cfg: TrainConfig, model: nn.Module, world_size: int) -> torch.optim.Optimizer:
    lr = cfg.learning_rate * lr_scale(cfg.lr_scaling, cfg.accum_steps, world_size)
    fused = next(model.parameters()).is_cuda  # the fused kernels exist on CUDA only
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(),
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            fused=fused or None,
        )
    return torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=fused or None
    )


def lr_factor(
    step: int, *, kind: str, warmup_steps: int, total_steps: int, decay_every: int, gamma: float
) -> float:
    """Learning-rate multiplier after ``step`` optimizer steps: linear warm-up, then the schedule."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if kind == "step":
        return gamma ** (step // decay_every)
    return 1.0


def build_scheduler(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    factor = partial(
        lr_factor,
        kind=cfg.scheduler,
        warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
        total_steps=cfg.epochs * steps_per_epoch,
        decay_every=max(1, cfg.step_size * steps_per_epoch),
        gamma=cfg.gamma,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def restore_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``, then this run's implementation options back in
    every param group, and every state tensor shaped like its parameter.

    ``load_state_dict`` restores the saved groups whole, ``fused``/``foreach`` included, and
    keeps each state tensor's saved strides. So a checkpoint written on another device or
    memory layout breaks the resumed run: a CPU checkpoint resumed on CUDA loses ``fused`` while
    the GradScaler passes ``grad_scale`` ("Expected grad_scale and found_inf to be None"); a
    channels_last switch makes CUDA's fused kernel refuse mismatched layouts; a CUDA checkpoint
    resumed on the CPU brings ``fused=True`` back, and the CPU fused kernel pairs channels_last
    moments with contiguous parameters element by element: silently wrong updates.

    Values are kept exactly: moments are copied into tensors laid out like their parameter
    (``empty_like`` keeps its device, dtype and strides; ``copy_`` maps element to element by
    index), and ``step`` keeps its value where this run's options want it: on the parameter's
    device as float32 for fused or capturable kernels, else on the host (as torch.optim keeps it
    so that no kernel launch is needed to count steps).
    """
    own = [
        {key: group[key] for key in IMPLEMENTATION_OPTIONS if key in group}
        for group in optimizer.param_groups
    ]
    optimizer.load_state_dict(state_dict)
    with torch.no_grad():
        for group, options in zip(optimizer.param_groups, own, strict=True):
            group.update(options)
            step_on_device = bool(group.get("fused") or group.get("capturable"))
            for param in group["params"]:
                state = optimizer.state.get(param)
                for key, value in (state or {}).items():
                    if torch.is_tensor(value):
                        state[key] = _like_param(key, value, param, step_on_device)


def _like_param(
    key: str, value: torch.Tensor, param: torch.Tensor, step_on_device: bool
) -> torch.Tensor:
    if key == "step":
        return (
            value.to(device=param.device, dtype=torch.float32)
            if step_on_device
            else value.to("cpu")
        )
    if value.shape != param.shape:  # a per-parameter scalar or the like: its device only
        return value.to(param.device)
    dtype = param.dtype if value.is_floating_point() else value.dtype
    return torch.empty_like(param, dtype=dtype).copy_(value)

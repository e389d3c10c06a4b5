"""The optimizer, its learning-rate schedule, and its state across runs.

A resumed optimizer runs with this run's own kernels and its parameters' device, dtype and
memory layout, whatever the checkpoint was written with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from timm.optim import param_groups_weight_decay
from torch import nn

from imgtrainer import torch_compat
from imgtrainer.config import TrainConfig
from imgtrainer.errors import UserError
from imgtrainer.models import unwrap_model

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
    groups = param_groups(cfg, unwrap_model(model), lr)
    fused = torch_compat.fused_optimizer_kernels_exist(next(model.parameters()).device)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            groups,
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            fused=fused or None,
        )
    return torch.optim.AdamW(groups, lr=lr, weight_decay=cfg.weight_decay, fused=fused or None)


def param_groups(cfg: TrainConfig, model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, each named by its ``part`` (backbone or head) and
    listing its ``param_names`` (the plain model's, so resuming can match parameters by name).

    Only the groups the flags need: with --decay_norm_and_bias and no head flags, one group in
    ``model.parameters()`` order, the layout of checkpoints written before these flags existed.
    Otherwise timm's ``param_groups_weight_decay`` takes every 1-D parameter (normalisation
    weights, biases) and the model's ``no_weight_decay()`` names out of the weight decay, and
    with --head_lr_scale or --freeze_backbone_epochs each group is split into the backbone's
    and the head's (``get_classifier()``) parameters, the head's at ``lr * head_lr_scale``.
    """
    names = {param: name for name, param in model.named_parameters()}
    if cfg.decay_norm_and_bias:
        by_decay = [{"params": list(model.parameters()), "weight_decay": cfg.weight_decay}]
    else:
        skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
        by_decay = param_groups_weight_decay(model, cfg.weight_decay, no_weight_decay_list=skip)
    split_head = cfg.head_lr_scale != 1.0 or cfg.freeze_backbone_epochs > 0
    head = {id(p) for p in classifier_head(model).parameters()} if split_head else set()
    groups = []
    for part, scale in (("backbone", 1.0), ("head", cfg.head_lr_scale)):
        for group in by_decay:
            params = [p for p in group["params"] if (id(p) in head) == (part == "head")]
            if params:
                groups.append(
                    {
                        **group,
                        "params": params,
                        "param_names": [names[p] for p in params],
                        "lr": lr * scale,
                        "part": part,
                    }
                )
    return groups


def classifier_head(model: nn.Module) -> nn.Module:
    """The classifier timm's ``get_classifier()`` names: what --head_lr_scale scales and what
    --freeze_backbone_epochs keeps training."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if not isinstance(head, nn.Module) or not any(True for _ in head.parameters()):
        raise UserError(
            f"--head_lr_scale / --freeze_backbone_epochs need a classifier head with "
            f"parameters (timm's get_classifier()); {type(model).__name__} has none"
        )
    return head


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


def frozen_then(step: int, *, frozen_steps: int, factor: Callable[[int], float]) -> float:
    """The backbone's multiplier under --freeze_backbone_epochs: 0 for the first
    ``frozen_steps`` steps (its parameters do not move, and AdamW's decoupled decay and SGD's
    weight decay, both scaled by the learning rate, leave them alone), then the schedule's."""
    return 0.0 if step < frozen_steps else factor(step)


def build_scheduler(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """One schedule for every group, scaling each group's own base learning rate (so the head
    stays --head_lr_scale times the backbone); the backbone's is 0 while it is frozen. A pure
    function of the step count: resuming restores the step count and nothing else."""
    factor = partial(
        lr_factor,
        kind=cfg.scheduler,
        warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
        total_steps=cfg.epochs * steps_per_epoch,
        decay_every=max(1, cfg.step_size * steps_per_epoch),
        gamma=cfg.gamma,
    )
    backbone = partial(
        frozen_then, frozen_steps=cfg.freeze_backbone_epochs * steps_per_epoch, factor=factor
    )
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        [
            backbone if group.get("part") == "backbone" else factor
            for group in optimizer.param_groups
        ],
    )


def restore_scheduler_state(
    scheduler: torch.optim.lr_scheduler.LambdaLR, state_dict: dict[str, Any]
) -> None:
    """``scheduler.load_state_dict`` without the saved lambdas' attributes: the lambdas are
    built from this run's flags (partials, whose saved attributes are empty), and a checkpoint
    with another number of param groups (--resume_override) would not index into them."""
    scheduler.load_state_dict({**state_dict, "lr_lambdas": [None] * len(scheduler.lr_lambdas)})


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    model: nn.Module | None = None,
    regroup: bool = False,
) -> None:
    """``optimizer.load_state_dict(state_dict)``, then this run's implementation options back in
    every param group, and every state tensor shaped like its parameter.

    A saved param-group layout other than this run's (the flags that choose the groups
    changed) is refused with one line, unless ``regroup`` (--resume_override): then each
    parameter's state moves to its group here, matched by name (``regroup_by_name``).

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
    if not same_layout(state_dict["param_groups"], optimizer.param_groups):
        if not regroup:
            raise UserError(
                f"cannot resume: the checkpoint's optimizer has parameter groups of "
                f"{group_sizes(state_dict['param_groups'])} parameters, this run's flags "
                f"make {group_sizes(optimizer.param_groups)} (--decay_norm_and_bias, "
                "--head_lr_scale, --freeze_backbone_epochs choose them); resume with the "
                "flags it was written with, or add --resume_override"
            )
        state_dict = regroup_by_name(state_dict, optimizer, model)
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


def group_sizes(groups: list[dict[str, Any]]) -> list[int]:
    return [len(group["params"]) for group in groups]


def same_layout(saved: list[dict[str, Any]], groups: list[dict[str, Any]]) -> bool:
    """The same parameters in the same groups: by name where both say (a checkpoint from
    before names were saved has one group in model order, which the sizes tell)."""
    if group_sizes(saved) != group_sizes(groups):
        return False
    if all("param_names" in g for g in saved) and all("param_names" in g for g in groups):
        return [g["param_names"] for g in saved] == [g["param_names"] for g in groups]
    return True


def regroup_by_name(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module | None
) -> dict[str, Any]:
    """The saved per-parameter state laid out in ``optimizer``'s groups, matched by parameter
    name, with this run's group hyperparameters (--resume_override then sets the learning
    rates from the schedule). Saved names are the groups' ``param_names``; a checkpoint from
    before them has one group in ``model.parameters()`` order."""
    saved_groups = state_dict["param_groups"]
    saved_ids = [i for group in saved_groups for i in group["params"]]
    if all("param_names" in group for group in saved_groups):
        saved_names = [name for group in saved_groups for name in group["param_names"]]
    elif len(saved_groups) == 1 and model is not None:
        saved_names = [name for name, _ in model.named_parameters()]
    else:
        saved_names = []
    if len(saved_names) != len(saved_ids) or not all(
        "param_names" in group for group in optimizer.param_groups
    ):
        raise UserError(
            "cannot resume: the checkpoint's optimizer state does not say which parameter "
            "each entry belongs to, and this run groups them differently; resume with the "
            "flags it was written with"
        )
    saved_state = dict(
        zip(saved_names, (state_dict["state"].get(i) for i in saved_ids), strict=True)
    )
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        ids = []
        for name in group["param_names"]:
            if saved_state.get(name) is not None:
                state[index] = saved_state[name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


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

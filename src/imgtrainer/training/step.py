"""One training step (``train_step``); it knows nothing about ranks or files.

Metrics are summed on the device, never read inside the step. A ``MemoryPlan`` splits each
optimizer batch into micro-batches weighted by their share of it; DDP exchanges gradients once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from imgtrainer import torch_compat
from imgtrainer.distributed.collectives import any_rank
from imgtrainer.precision import Precision
from imgtrainer.torch_compat import none_if_out_of_memory, release_memory
from imgtrainer.training.memory import BufferSnapshot, MemoryPlan

log = logging.getLogger(__name__)


# Index of each running sum in the metric tensors.
LOSS, CORRECT, COUNT = 0, 1, 2  # training: [loss_sum, correct, count]


TOP5 = 3  # evaluation adds correct-in-top-5


@dataclass
class RunParts:
    """The run's parts that a training step works with, built once per run
    (``training.build.build_run_parts``); the trainer, the benchmarks and the tests share it."""

    model: nn.Module  # as trained: DDP and/or compiled, on the device
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    precision: Precision
    plan: MemoryPlan  # the micro-batch; halved on out-of-memory if it allows
    device: torch.device
    clip_grad_norm: float = 0.0  # max total gradient norm per optimizer step; 0: off
    plain_model: nn.Module | None = None  # the same weights unwrapped (what checkpoints save)
    # With ``plan.retry_on_oom``: the copies of the buffers each step snapshots into.
    buffer_snapshot: BufferSnapshot | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.plain_model is None:
            self.plain_model = self.model


def train_step(
    state: RunParts, images: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on one loaded batch; returns its [loss_sum, correct, count], and
    (with a GradScaler) a device flag set when the scaler skipped the step.

    With ``plan.retry_on_oom``, an out-of-memory error on any rank makes every rank drop the
    step's partial gradients and metrics, put back the BatchNorm statistics, and redo the step
    from its start with half the micro-batch: no sample is skipped or counted twice.
    """
    model, plan, scaler = state.model, state.plan, state.scaler
    snapshot = _buffer_snapshot(state) if plan.retry_on_oom else None
    while True:
        state.optimizer.zero_grad(set_to_none=True)
        step_sums = accumulate_gradients(state, images, targets)
        if step_sums is not None:
            break
        snapshot.restore()
        release_memory(state.device)
        failed_size = plan.size_for(len(targets))
        plan.shrink(len(targets))  # every rank: they agreed on the failure
        ddp = ddp_of(model)
        if ddp is not None:
            torch_compat.reset_ddp_after_failed_attempt(ddp)
        log.warning(
            f"out of memory with micro-batch {failed_size}; redoing this step "
            f"with micro-batch {plan.micro_batch}"
        )
    # The GradScaler unscales the accumulated gradient once, and skips the step if any
    # micro-batch overflowed in float16 (then ``update`` lowers the scale: compared on the
    # device, without waiting for it).
    scale_before = (
        torch_compat.grad_scale_on_device(scaler).clone() if scaler.is_enabled() else None
    )
    if state.clip_grad_norm:
        clip_gradients(state)
    scaler.step(state.optimizer)
    scaler.update()
    skipped = (
        None if scale_before is None else torch_compat.grad_scale_on_device(scaler) < scale_before
    )
    return step_sums, skipped


def _buffer_snapshot(state: RunParts) -> BufferSnapshot:
    """The step's copy of the model's buffers, taken into the copies the previous step made
    (no allocation per step)."""
    if state.buffer_snapshot is None:
        state.buffer_snapshot = BufferSnapshot(state.model)
        return state.buffer_snapshot
    return state.buffer_snapshot.take(state.model)


def clip_gradients(state: RunParts) -> None:
    """Clip the step's whole gradient (every micro-batch's, accumulated) to
    ``state.clip_grad_norm``. Under a GradScaler the gradients are unscaled first, or the limit
    would apply to the loss-scaled ones; ``scaler.step`` then knows they are unscaled, and still
    skips the step if they overflowed. Only groups that learn this step count: a frozen
    backbone's gradients (learning rate 0) do not shrink the head's."""
    state.scaler.unscale_(state.optimizer)
    params = [
        p
        for group in state.optimizer.param_groups
        if group["lr"] > 0
        for p in group["params"]
        if p.grad is not None
    ]
    torch.nn.utils.clip_grad_norm_(params, state.clip_grad_norm)


def accumulate_gradients(
    state: RunParts, images: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor | None:
    """Forward and backward over the micro-batches of one batch; returns the step's metric sums,
    or None on every rank when any rank ran out of memory (only with ``plan.retry_on_oom``).

    Ranks agree twice, on the host, at points every rank reaches exactly once per attempt:
    after copying the inputs, before the first forward (under DDP a forward may run a
    collective: the bucket rebuild after a redone step, so a rank that failed in its copy must
    not skip it while the others are in it); and after the forwards, before the last
    micro-batch's backward where DDP exchanges gradients (a rank that ran out of memory in an
    earlier micro-batch stops and waits there).
    """
    model, scaler, plan, device = state.model, state.scaler, state.plan, state.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    size = plan.size_for(len(targets))
    chunks = _inputs_on_device(images, targets, size, device, plan)
    if plan.retry_on_oom and any_rank(chunks is None):
        return None
    last_loss, failed = None, False
    for index, (x, y) in enumerate(chunks):
        is_last = index == len(chunks) - 1
        micro_batch = partial(_micro_batch, state, x, y, len(y) / len(targets), sums, is_last)
        last_loss = none_if_out_of_memory(micro_batch, plan.retry_on_oom)
        if last_loss is None:
            failed = True
            break
    del chunks  # each micro-batch's input can go once its backward ran
    if plan.retry_on_oom and any_rank(failed):
        return None
    return sums if _synced_backward(model, scaler, last_loss, plan) else None


def _micro_batch(
    state: RunParts,
    images: torch.Tensor,
    targets: torch.Tensor,
    share: float,
    sums: torch.Tensor,
    is_last: bool,
) -> torch.Tensor:
    """One micro-batch's forward, its metrics added to ``sums``, and its backward but for the
    last one's (``_synced_backward``); returns its loss weighted by its ``share`` of the batch,
    so that the micro-batch gradients add up to the gradient of the mean loss over the batch."""
    with contextlib.nullcontext() if is_last else _no_sync(state.model):
        logits, loss = forward_loss(state.model, images, targets, state.criterion, state.precision)
    add_to_step_sums(sums, logits, loss, targets)
    weighted = loss * share
    if not is_last:
        state.scaler.scale(weighted).backward()
    return weighted


def _inputs_on_device(
    images: torch.Tensor, targets: torch.Tensor, size: int, device: torch.device, plan: MemoryPlan
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Every micro-batch of the batch on the device (the fitting counts the whole batch's
    inputs there), or None if that ran out of memory and the plan retries."""

    def copy() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            to_device(x, y, device, plan.channels_last)
            for x, y in zip(images.split(size), targets.split(size), strict=True)
        ]

    return none_if_out_of_memory(copy, plan.retry_on_oom)


# Under DDP the other ranks are already inside the gradient exchange, which cannot be called off.
EXCHANGE_OUT_OF_MEMORY = (
    "out of memory during the gradient exchange of the last micro-batch, which cannot be "
    "redone on one rank alone; restart with --resume auto (and a smaller --max_memory_gb)"
)


def _synced_backward(
    model: nn.Module, scaler: torch.amp.GradScaler, loss: torch.Tensor, plan: MemoryPlan
) -> bool:
    """The last micro-batch's backward, where DDP exchanges gradients. False if it ran out of
    memory and can be redone: only without DDP; under DDP the error ends the run."""

    def backward() -> bool:
        scaler.scale(loss).backward()
        return True

    cannot_redo = EXCHANGE_OUT_OF_MEMORY if ddp_of(model) is not None else ""
    return none_if_out_of_memory(backward, plan.retry_on_oom, cannot_redo=cannot_redo) is not None


def ddp_of(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of ``model``, also when torch.compile wrapped it, or None."""
    model = torch_compat.compiled_original(model)
    return model if isinstance(model, DistributedDataParallel) else None


def _no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` (accumulate locally, exchange nothing), or nothing for a plain model."""
    ddp = ddp_of(model)
    return ddp.no_sync() if ddp is not None else contextlib.nullcontext()


def to_device(
    images: torch.Tensor, targets: torch.Tensor, device: torch.device, channels_last: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move one micro-batch to the device, in the model's memory layout."""
    layout = torch.channels_last if channels_last else torch.preserve_format
    return (
        images.to(device, non_blocking=True, memory_format=layout),
        targets.to(device, non_blocking=True),
    )


def forward_loss(
    model: nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor,
    criterion: nn.Module,
    precision: Precision,
) -> tuple[torch.Tensor, torch.Tensor]:
    with precision.autocast(images.device):
        logits = model(images)
        loss = criterion(logits, targets)
    return logits, loss


@torch.no_grad()
def add_to_step_sums(
    sums: torch.Tensor, logits: torch.Tensor, loss: torch.Tensor, targets: torch.Tensor
) -> None:
    """A micro-batch's loss sum, correct predictions and count added to the step's ``sums``."""
    sums[LOSS] += loss.detach().double() * targets.size(0)
    # Soft targets (mixup/cutmix): a prediction is correct when it is the target's dominant
    # label, the one with the larger share of the mixed image.
    labels = targets.argmax(dim=1) if targets.ndim == 2 else targets
    sums[CORRECT] += (logits.argmax(dim=1) == labels).sum()
    sums[COUNT] += targets.size(0)


# Called by ``evaluate`` with each micro-batch's float32 logits, top-1 predictions and targets,
# on the device, in the order the loader yields them: per-sample work such as a confusion matrix.
PredictionHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

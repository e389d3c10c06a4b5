"""The micro-batch that fits the memory cap, found by trials."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from imgtrainer.checkpoints.files import tensor_bytes
from imgtrainer.config import TrainConfig, optimizer_batch
from imgtrainer.data import (
    Source,
    augment_bytes_per_image,
    augment_chunk,
    canvas_side_bound,
    staged_bytes,
)
from imgtrainer.distributed.collectives import all_reduce_min
from imgtrainer.errors import UserError
from imgtrainer.events import event
from imgtrainer.precision import uses_channels_last
from imgtrainer.torch_compat import none_if_out_of_memory
from imgtrainer.training.memory import (
    OOM_HELP,
    BufferSnapshot,
    MemoryPlan,
    checkpointing_in_use,
    gib,
    halving_sizes,
    memory_budget,
)
from imgtrainer.training.memory_probes import (
    ResidentMemory,
    StepCost,
    batch_input_bytes,
    cpu_baseline,
    optimizer_state_bytes,
    saved_tensor_bytes,
)
from imgtrainer.training.step import RunParts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialParts:
    """What a micro-batch trial runs: the plain model (no collective may run in a trial), its
    optimizer, loss and precision, on ``device``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    precision: Any
    device: torch.device

    @classmethod
    def of(cls, parts: RunParts) -> TrialParts:
        return cls(
            parts.plain_model, parts.optimizer, parts.criterion, parts.precision, parts.device
        )


@dataclass(frozen=True)
class TrialInputs:
    """The synthetic batch of a trial. ``loaded_input_bytes``: the loaded batch's inputs on the
    device during a step (``batch_input_bytes``), counted instead of the trial's own input when
    larger."""

    image_shape: tuple[int, int, int]
    num_classes: int
    channels_last: bool = False
    loaded_input_bytes: int = 0


def measure_micro_batch(
    parts: TrialParts,
    inputs: TrialInputs,
    size: int,
    *,
    cpu_baseline_bytes: int | None = None,
    resident: ResidentMemory | None = None,
) -> StepCost:
    """Run one forward and backward of ``size`` synthetic images and return what it cost. On
    the CPU, with ``cpu_baseline_bytes`` (``cpu_baseline``) and ``resident``, the real peak is
    the resident high-water mark of the trial above that baseline.

    Synthetic images, because a trial must not use up samples of the epoch (resuming relies on
    the loader's position). The model's buffers, its gradients and the random state are left as
    they were. An out-of-memory error propagates to the caller."""
    model, device = parts.model, parts.device
    measure_rss = (
        device.type == "cpu"
        and cpu_baseline_bytes is not None
        and resident is not None
        and resident.available
    )
    if measure_rss:
        resident.reset_peak()
    images, targets = _synthetic_batch(inputs, size, device)
    image_bytes = tensor_bytes([images])
    snapshot, was_training = BufferSnapshot(model), model.training
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        batch_bytes = _trial_step(parts, images, targets)
        peak = 0
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        elif measure_rss:
            peak = resident.peak() - cpu_baseline_bytes
        if peak:
            peak -= image_bytes  # counted with the inputs below
            if not parts.optimizer.state:  # not allocated yet: it will be at the first step
                peak += optimizer_state_bytes(parts.optimizer)
    finally:
        model.zero_grad(set_to_none=True)
        snapshot.restore()
        model.train(was_training)
    state = resident_state_bytes(parts)
    return StepCost(size, state, batch_bytes, peak, max(image_bytes, inputs.loaded_input_bytes))


def _synthetic_batch(
    inputs: TrialInputs, size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random images of ``inputs``' shape and layout and their labels, on ``device``,
    the same for the same size."""
    generator = torch.Generator().manual_seed(size)
    images = torch.randn(size, *inputs.image_shape, generator=generator).to(
        device,
        memory_format=torch.channels_last if inputs.channels_last else torch.preserve_format,
    )
    targets = torch.randint(0, inputs.num_classes, (size,), generator=generator).to(device)
    return images, targets


def _trial_step(parts: TrialParts, images: torch.Tensor, targets: torch.Tensor) -> int:
    """The trial's forward and backward, in training mode and on a forked random state; returns
    the bytes the forward kept for the backward (the input aside)."""
    model, device = parts.model, parts.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.train()
        # As in every micro-batch after a step's first: the accumulated gradients are
        # already there during the forward pass (and backward adds into them).
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        with saved_tensor_bytes(model, exclude=images) as saved, parts.precision.autocast(device):
            loss = parts.criterion(model(images), targets)
        loss.backward()
    return sum(saved.values())


def resident_state_bytes(parts: TrialParts) -> int:
    """What stays in memory through a step: parameters and their gradients, buffers, and the
    optimizer's state."""
    return (
        2 * tensor_bytes(parts.model.parameters())
        + tensor_bytes(parts.model.buffers())
        + optimizer_state_bytes(parts.optimizer)
    )


# ----------------------------------------------------------------------------- fitting


def largest_fitting(
    measure: Callable[[int], StepCost],
    start: int,
    batch_size: int,
    budget: int,
    device: torch.device = torch.device("cpu"),
) -> tuple[int, str]:
    """The largest size from ``halving_sizes(start, batch_size)`` whose measured cost fits in
    ``budget`` bytes, and ``(0, why)`` when not even 1 does. This rank only: no collective."""
    probe_size = min(2, start)
    probe = none_if_out_of_memory(partial(measure, probe_size), release=device)
    why = "out of memory"
    for size in halving_sizes(start, batch_size):
        if probe is None and size >= probe_size:
            continue  # the probe ran out of memory: no larger size can fit
        if probe is not None and size != probe_size and probe.estimate(size) > budget:
            why = f"estimated {gib(probe.estimate(size))}"
            log.info(f"micro-batch {size}: {why}, over the budget of {gib(budget)}")
            continue  # a trial would only overshoot the budget
        cost = (
            probe
            if size == probe_size
            else none_if_out_of_memory(partial(measure, size), release=device)
        )
        if cost is not None and cost.total <= budget:
            log.info(
                f"micro-batch {size}: needs {gib(cost.total)}, within the budget of {gib(budget)}"
            )
            return size, ""
        why = "out of memory" if cost is None else f"needs {gib(cost.total)}"
        log.info(f"micro-batch {size}: {why}, over the budget of {gib(budget)}")
    return 0, why


def fit_micro_batch(
    measure: Callable[[int], StepCost],
    start: int,
    batch_size: int,
    budget: int,
    device: torch.device,
) -> int:
    """``largest_fitting`` on every rank, then the smallest size any rank found. Every rank must
    call it. Sizes are agreed (rather than each rank using its own) because DDP needs every rank
    to run the same number of backward passes per step."""
    local, why = largest_fitting(measure, start, batch_size, budget, device)
    agreed = int(all_reduce_min(torch.tensor([local], device=device)).item())
    if agreed == 0:
        where = why if local == 0 else "on another process"
        raise UserError(
            f"out of memory even with a micro-batch of 1 ({where}; budget "
            f"{gib(budget)}); {OOM_HELP}"
        )
    if agreed < local:
        log.info(
            f"micro-batch {agreed}: the smallest that fits on every process (this one fits {local})"
        )
    return agreed


def build_memory_plan(
    cfg: TrainConfig,
    parts: TrialParts,
    processes_on_device: int,
    num_classes: int,
    source: Source = Source.FILES,
) -> MemoryPlan:
    """The micro-batch of this run: ``--batch_size`` (an optimizer step is ``--accum_steps``
    of them), or with ``--auto_micro_batch`` the largest divisor of the step's batch up to
    ``--batch_size`` that fits, found by trials on ``parts`` (the plain, unwrapped model: trials
    of different sizes on different ranks must run no collective), and the images augmented
    at a time (``plan_augmentation``) from the training images' ``source``. Every rank must
    call it."""
    device, model = parts.device, parts.model
    start, step_batch = cfg.batch_size, optimizer_batch(cfg)
    channels_last = uses_channels_last(cfg.channels_last, device)
    plan = MemoryPlan(start, retry_on_oom=cfg.auto_micro_batch, channels_last=channels_last)
    if cfg.auto_micro_batch:
        budget = memory_budget(cfg.max_memory_gb, device, processes_on_device)
        resident = ResidentMemory()
        inputs = TrialInputs(
            (3, cfg.image_size, cfg.image_size),
            num_classes,
            channels_last,
            batch_input_bytes(step_batch, cfg.image_size),
        )
        measure = partial(
            measure_micro_batch,
            parts,
            inputs,
            cpu_baseline_bytes=cpu_baseline(model, parts.optimizer, resident)
            if device.type == "cpu"
            else None,
            resident=resident,
        )
        # The batches prepared ahead stay alive through the step: their room is not the step's.
        ahead = prepared_ahead_bytes(cfg, source)
        plan.micro_batch = fit_micro_batch(measure, start, step_batch, budget - ahead, device)
        plan.augment_chunk = plan_augmentation(cfg, parts, inputs, budget, source)
        if device.type == "cuda":
            # Drop the trials' cached blocks, and their peak (an out-of-memory trial peaks near
            # the device's limit) from the peak_memory_mb that the history reports.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    precision = parts.precision
    dtype = str(precision.dtype).removeprefix("torch.") if precision.enabled else "float32"
    checkpointing = checkpointing_in_use(model)
    fields = {"step_batch": step_batch, "dtype": dtype, "checkpointing": checkpointing}
    facts = event("memory", **asdict(plan), **fields)
    log.info(
        f"Memory: micro-batch {plan.micro_batch} ({step_batch // plan.micro_batch} "
        f"forward/backward pass(es) per optimizer step of {step_batch} images per "
        f"process), {dtype}, channels_last {'on' if channels_last else 'off'}, "
        f"activation checkpointing {checkpointing}"
        + (", halving on out-of-memory" if plan.retry_on_oom else "")
        + (f", augmenting {plan.augment_chunk} images at a time" if plan.augment_chunk else ""),
        extra=facts,
    )
    return plan


def plan_augmentation(
    cfg: TrainConfig, parts: TrialParts, inputs: TrialInputs, budget: int, source: Source
) -> int | None:
    """The images augmented at a time so that the augmentation's transient memory
    (``augment_bytes_per_image``) fits in ``budget`` beside the model's state, the loaded
    batch's inputs and the batches being prepared (``staged_bytes``); None when the whole
    loaded batch fits. The same on every rank (the same shapes and budget rule); a rank that
    runs out anyway halves its own (no collective depends on it)."""
    step_batch = optimizer_batch(cfg)
    side = canvas_side_bound(cfg.image_size, source)
    staged = staged_bytes(step_batch, cfg.image_size, source)
    room = budget - resident_state_bytes(parts) - inputs.loaded_input_bytes - staged
    per_image = augment_bytes_per_image(cfg.image_size, side, cfg.auto_augment != "none")
    if room < per_image:
        raise UserError(
            f"the memory budget ({gib(budget)}) leaves no room to augment one image beside the "
            f"model's state and {gib(staged)} of batches on their way to the device; "
            f"{OOM_HELP}"
        )
    chunk = augment_chunk(room, per_image, step_batch)
    return None if chunk == step_batch else chunk


def prepared_ahead_bytes(cfg: TrainConfig, source: Source) -> int:
    """Device bytes of the batches prepared ahead while a step runs (``staged_bytes`` but the
    canvas being augmented, which is gone by then)."""
    step_batch = optimizer_batch(cfg)
    canvas = step_batch * 3 * canvas_side_bound(cfg.image_size, source) ** 2
    return max(0, staged_bytes(step_batch, cfg.image_size, source) - canvas)

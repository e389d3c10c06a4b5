"""Fitting training into a memory budget: the micro-batch size, what it costs, and recovery from
out-of-memory errors.

Each loaded batch (``--batch_size`` x ``--accum_steps`` images per process: one optimizer step)
goes through the model as micro-batches of ``MemoryPlan.micro_batch`` images, whose gradients the
engine adds up: ``--batch_size`` images each, unless fitting finds that fewer fit. This module
chooses that size:

* ``measure_micro_batch`` runs one forward and backward on synthetic images and returns what it
  costs: the bytes the forward pass keeps for backward (counted with ``saved_tensors_hooks``), the
  loaded batch's inputs, and the weights, gradients and optimizer state; and the real peak: on
  CUDA the allocator's, on the CPU the process's resident high-water mark above what it held
  before training (``ResidentMemory``). A CPU with RAM to spare never raises out-of-memory, so
  there the measured peak is what a budget (``--max_memory_gb``) is checked against: the count
  of saved tensors misses what the CPU kernels and the allocator hold (~half of the real peak).
* ``fit_micro_batch`` starts at ``--batch_size`` and halves: it skips the sizes
  that a linear estimate from a 2-image probe already puts over the budget (a trial would only
  overshoot it), and tries the others for real, halving on out-of-memory; every rank then takes
  the smallest size any rank found, so all ranks run the same number of micro-batches.

It never reads files; its only collective is that agreement.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from config import optimizer_batch
from distributed import all_reduce_min
from errors import UserError

log = logging.getLogger(f"trainer.{__name__}")  # under the project logger

GIB = 2**30

# What helps when even one image per forward/backward does not fit.
OOM_HELP = (
    "what would help: --low_memory (float16 and activation checkpointing), a smaller "
    "--image_size, a smaller --model, or more memory (a larger --max_memory_gb, or "
    "closing other programs that use the GPU)"
)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


# ----------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """How each loaded batch goes through the model. Mutable on purpose: the engine halves
    ``micro_batch`` when an out-of-memory error forces it, and the trainer stores the value in
    checkpoints and history."""

    micro_batch: int | None = None  # images per forward/backward; None: the whole batch
    retry_on_oom: bool = False  # on out-of-memory, halve and redo the step (ranks agree)
    channels_last: bool = False  # move inputs in channels_last layout (the model is too)

    def size_for(self, batch_size: int) -> int:
        return batch_size if self.micro_batch is None else min(self.micro_batch, batch_size)

    def shrink(self, batch_size: int) -> None:
        """Halve the micro-batch after an out-of-memory error; one clear error below 1 image."""
        current = self.size_for(batch_size)
        if current == 1:
            raise UserError(
                f"out of memory even with a micro-batch of 1 during training; {OOM_HELP}"
            )
        self.micro_batch = smaller_micro_batch(current, batch_size)


def smaller_micro_batch(current: int, batch_size: int) -> int:
    """The largest divisor of ``batch_size`` that is at most half of ``current`` (1 at least):
    halving, but every micro-batch of a step keeps the same size."""
    return max(d for d in range(1, max(1, current // 2) + 1) if batch_size % d == 0)


def halving_sizes(start: int, batch_size: int) -> list[int]:
    """``start`` and each smaller size ``smaller_micro_batch`` leads to, down to 1."""
    sizes = [start]
    while sizes[-1] > 1:
        sizes.append(smaller_micro_batch(sizes[-1], batch_size))
    return sizes


# How memory exhaustion reads when it is not torch's own OutOfMemoryError, lower-cased: the CPU
# allocator; MPS; cuDNN, which reports a convolution whose workspace cannot be allocated as having
# no usable algorithm or engine; cuBLAS failing to allocate its handle or workspace.
OUT_OF_MEMORY_MESSAGES = (
    "out of memory",
    "can't allocate memory",
    "unable to find a valid cudnn algorithm",
    "was unable to find an engine",  # cuDNN v8/v9 frontend: "GET was unable to ..."
    "cudnn_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "cublas_status_alloc_failed",
)


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or memory exhaustion reported as a plain RuntimeError: the CPU's
    "can't allocate memory", MPS's "out of memory", and on CUDA the cuDNN and cuBLAS errors that
    usually mean their workspace did not fit (so fitting and the retry halve instead of crash)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in text for m in OUT_OF_MEMORY_MESSAGES)


def release_memory(device: torch.device) -> None:
    """Give the blocks of a failed attempt back, so the smaller retry is not fragmented."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class BufferSnapshot:
    """A copy of a model's buffers (BatchNorm running statistics). A step that is redone, or a
    trial forward pass, must not leave its samples counted in those statistics."""

    def __init__(self, model: nn.Module):
        self.pairs = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.pairs:
                buffer.copy_(saved)


# ----------------------------------------------------------------------------- model set-up


def enable_memory_savers(
    model: nn.Module, *, grad_checkpointing: bool, channels_last: bool
) -> None:
    """Activation checkpointing (timm's ``set_grad_checkpointing``) and the channels_last
    layout. Call before DDP wraps the model: DDP lays out its buckets from the parameters."""
    if grad_checkpointing:
        try:
            model.set_grad_checkpointing(True)
        except (AttributeError, NotImplementedError, AssertionError) as err:
            log.warning(
                f"{type(model).__name__} has no activation checkpointing in "
                f"timm ({err or type(err).__name__}); training without it"
            )
    if channels_last:
        model.to(memory_format=torch.channels_last)


def memory_budget(
    max_memory_gb: float | None, device: torch.device, processes_on_device: int
) -> int:
    """Bytes one process may use: ``--max_memory_gb``, else what the device has (on the CPU,
    the RAM shared by this node's processes)."""
    if max_memory_gb is not None:
        return int(max_memory_gb * GIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, processes_on_device)


# ----------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class StepCost:
    """What one forward and backward of ``size`` images costs, in bytes."""

    size: int
    state_bytes: int  # weights, gradients, buffers and optimizer state
    batch_bytes: int  # what the forward pass keeps for backward (the input aside)
    peak_bytes: int = 0  # the real peak, the inputs aside (0: not measured), plus the
    # optimizer state still to come
    input_bytes: int = 0  # the loaded batch's inputs on the device during a step

    @property
    def total(self) -> int:
        return max(self.state_bytes + self.batch_bytes, self.peak_bytes) + self.input_bytes

    def estimate(self, size: int) -> int:
        """A first estimate for another size: the batch part grows linearly with it (the
        inputs of the loaded batch do not: every micro-batch size holds all of them)."""
        return self.state_bytes + self.batch_bytes * size // self.size + self.input_bytes


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer state's bytes, also before it exists (AdamW creates it at its first step)."""
    existing = sum(tensor_bytes(state.values()) for state in optimizer.state.values())
    if existing:
        return existing
    params = tensor_bytes(p for group in optimizer.param_groups for p in group["params"])
    if isinstance(optimizer, torch.optim.SGD):
        slots = 1 if any(group.get("momentum") for group in optimizer.param_groups) else 0
    else:
        slots = 2  # Adam/AdamW: two moments per parameter; a safe guess for others
    return slots * params


def batch_input_bytes(
    batch_size: int, image_size: int, device: torch.device, cache_images: str, channels_last: bool
) -> int:
    """Bytes of one loaded batch's float32 inputs that sit in ``device`` memory during its step.

    The engine copies every micro-batch of a step to the device before the first forward (so
    that an out-of-memory error there is agreed on before any collective), so the whole batch
    is on the device, not one micro-batch. On the CPU that is the loaded batch itself. With
    ``--cache_images gpu`` the loader already yields the batch on the device; the engine's
    channels_last copy of it is a second one. (While the next batch is collated, uint8 copies
    live for a moment too, but then the activations of the step before are already freed.)"""
    copies = 2 if device.type == "cuda" and cache_images == "gpu" and channels_last else 1
    return copies * batch_size * 3 * image_size * image_size * 4


class ResidentMemory:
    """This process's resident memory on Linux: ``VmRSS`` and its high-water mark ``VmHWM``
    from /proc/self/status, the mark reset through /proc/self/clear_refs (Linux 4.0+).

    Before each reset, glibc's ``malloc_trim`` hands freed heap pages back to the system: trials
    run from large to small, and memory a larger trial freed but glibc kept would otherwise be
    reused by the next one without raising the mark, hiding part of its peak.
    ``getrusage``'s ru_maxrss cannot serve: it never goes down."""

    STATUS = Path("/proc/self/status")
    CLEAR_REFS = Path("/proc/self/clear_refs")

    def __init__(self) -> None:
        self.available = self.STATUS.is_file() and self.reset_peak()

    @staticmethod
    def _trim() -> None:
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to hand back
            pass

    @staticmethod
    def return_freed_blocks() -> None:
        """From now on, glibc maps every block of 128 KiB or more on its own and unmaps it when
        freed. By default it raises that threshold as blocks are freed (up to 32 MiB), then
        serves tensors from its heap and keeps freed ones resident: a training run then holds
        more than its trial measured (~30-90 MB here). Costs page faults (a few % on the CPU)."""
        try:
            ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        except (OSError, AttributeError):
            pass

    def reset_peak(self) -> bool:
        self._trim()
        try:
            self.CLEAR_REFS.write_text("5")
            return True
        except OSError:
            return False

    def _field(self, name: str) -> int:
        for line in self.STATUS.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024  # kB
        raise RuntimeError(f"{name} not in {self.STATUS}")

    def current(self) -> int:
        return self._field("VmRSS")

    def peak(self) -> int:
        return self._field("VmHWM")


def resident_training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the weights, buffers and existing optimizer state: resident before the trials,
    yet part of what the budget covers."""
    existing = sum(tensor_bytes(state.values()) for state in optimizer.state.values())
    return tensor_bytes(model.parameters()) + tensor_bytes(model.buffers()) + existing


def cpu_baseline(
    model: nn.Module, optimizer: torch.optim.Optimizer, resident: ResidentMemory
) -> int | None:
    """What this process holds that the CPU budget does not cover (the interpreter, the
    libraries, the dataset and its cache): the resident memory now, less the training state.
    None where the resident memory cannot be measured. The budget then covers the same things
    as on CUDA, where the allocator counts neither the libraries nor the CUDA context."""
    if not resident.available:
        return None
    resident.return_freed_blocks()  # so that training holds what the trials measure
    resident.reset_peak()  # also trims: what glibc keeps from building the model is not held
    return resident.current() - resident_training_state(model, optimizer)


@contextlib.contextmanager
def saved_tensor_bytes(
    model: nn.Module, exclude: torch.Tensor | None = None
) -> Iterator[dict[int, int]]:
    """Counts the distinct storages that the forward pass inside keeps for backward, weights
    and ``exclude`` (the input) left out: they are counted once, elsewhere. The dict maps
    storage address to bytes."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if exclude is not None:
        weights.add(exclude.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield seen


def measure_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    precision: Any,
    device: torch.device,
    size: int,
    *,
    image_shape: tuple[int, int, int],
    num_classes: int,
    channels_last: bool = False,
    loaded_input_bytes: int = 0,
    cpu_baseline_bytes: int | None = None,
    resident: ResidentMemory | None = None,
) -> StepCost:
    """Run one forward and backward of ``size`` synthetic images on ``model`` (the plain model:
    no collective runs) and return what it cost.

    ``loaded_input_bytes``: the loaded batch's inputs on the device during a step
    (``batch_input_bytes``), counted instead of the trial's own input when larger. On the CPU,
    with ``cpu_baseline_bytes`` (``cpu_baseline``) and ``resident``, the real peak is the
    resident high-water mark of the trial above that baseline.

    Synthetic images, because a trial must not use up samples of the epoch (resuming relies on
    the loader's position). The model's buffers, its gradients and the random state are left as
    they were. An out-of-memory error propagates to the caller."""
    measure_rss = (
        device.type == "cpu"
        and cpu_baseline_bytes is not None
        and resident is not None
        and resident.available
    )
    if measure_rss:
        resident.reset_peak()
    generator = torch.Generator().manual_seed(size)
    images = torch.randn(size, *image_shape, generator=generator).to(
        device, memory_format=torch.channels_last if channels_last else torch.preserve_format
    )
    targets = torch.randint(0, num_classes, (size,), generator=generator).to(device)
    image_bytes = tensor_bytes([images])
    snapshot, was_training = BufferSnapshot(model), model.training
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model.train()
            # As in every micro-batch after a step's first: the accumulated gradients are
            # already there during the forward pass (and backward adds into them).
            for param in model.parameters():
                if param.requires_grad:
                    param.grad = torch.zeros_like(param)
            with saved_tensor_bytes(model, exclude=images) as saved, precision.autocast(device):
                loss = criterion(model(images), targets)
            loss.backward()
        batch_bytes = sum(saved.values())
        peak = 0
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        elif measure_rss:
            peak = resident.peak() - cpu_baseline_bytes
        if peak:
            peak -= image_bytes  # counted with the inputs below
            if not optimizer.state:  # not allocated yet: it will be at the first step
                peak += optimizer_state_bytes(optimizer)
    finally:
        model.zero_grad(set_to_none=True)
        snapshot.restore()
        model.train(was_training)
    state = (
        2 * tensor_bytes(model.parameters())
        + tensor_bytes(model.buffers())
        + optimizer_state_bytes(optimizer)
    )
    return StepCost(size, state, batch_bytes, peak, max(image_bytes, loaded_input_bytes))


# ----------------------------------------------------------------------------- fitting


def _cost_or_oom(
    measure: Callable[[int], StepCost], size: int, device: torch.device
) -> StepCost | None:
    try:
        return measure(size)
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
    release_memory(device)  # outside the except block: the traceback no longer pins tensors
    return None


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
    probe = _cost_or_oom(measure, probe_size, device)
    why = "out of memory"
    for size in halving_sizes(start, batch_size):
        if probe is None and size >= probe_size:
            continue  # the probe ran out of memory: no larger size can fit
        if probe is not None and size != probe_size and probe.estimate(size) > budget:
            why = f"estimated {gib(probe.estimate(size))}"
            log.info(f"micro-batch {size}: {why}, over the budget of {gib(budget)}")
            continue  # a trial would only overshoot the budget
        cost = probe if size == probe_size else _cost_or_oom(measure, size, device)
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
    cfg: Any,
    device: torch.device,
    processes_on_device: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    precision: Any,
    num_classes: int,
) -> MemoryPlan:
    """The micro-batch of this run: ``--batch_size`` (an optimizer step is ``--accum_steps``
    of them), or with ``--auto_micro_batch`` the largest divisor of the step's batch up to
    ``--batch_size`` that fits, found by trials on ``model`` (the plain, unwrapped model: trials
    of different sizes on different ranks must run no collective). Every rank must call it."""
    start, step_batch = cfg.batch_size, optimizer_batch(cfg)
    channels_last = cfg.channels_last and device.type == "cuda"
    plan = MemoryPlan(start, retry_on_oom=cfg.auto_micro_batch, channels_last=channels_last)
    if cfg.auto_micro_batch:
        budget = memory_budget(cfg.max_memory_gb, device, processes_on_device)
        resident = ResidentMemory()
        measure = partial(
            measure_micro_batch,
            model,
            optimizer,
            criterion,
            precision,
            device,
            image_shape=(3, cfg.image_size, cfg.image_size),
            num_classes=num_classes,
            channels_last=channels_last,
            loaded_input_bytes=batch_input_bytes(
                step_batch, cfg.image_size, device, cfg.cache_images, channels_last
            ),
            cpu_baseline_bytes=cpu_baseline(model, optimizer, resident)
            if device.type == "cpu"
            else None,
            resident=resident,
        )
        plan.micro_batch = fit_micro_batch(measure, start, step_batch, budget, device)
        if device.type == "cuda":
            # Drop the trials' cached blocks, and their peak (an out-of-memory trial peaks near
            # the device's limit) from the peak_memory_mb that the history reports.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    dtype = str(precision.dtype).removeprefix("torch.") if precision.enabled else "float32"
    checkpointing = "on" if getattr(model, "grad_checkpointing", False) else "off"
    log.info(
        f"Memory: micro-batch {plan.micro_batch} ({step_batch // plan.micro_batch} "
        f"forward/backward pass(es) per optimizer step of {step_batch} images per "
        f"process), {dtype}, channels_last {'on' if channels_last else 'off'}, "
        f"activation checkpointing {checkpointing}"
        + (", halving on out-of-memory" if plan.retry_on_oom else "")
    )
    return plan

"""What fitting training into a memory budget works with (docs/memory.md).

The plan of micro-batches and how it halves after an out-of-memory error (``MemoryPlan``), the
buffers a redone step puts back (``BufferSnapshot``), the memory savers (activation
checkpointing, channels_last) and each process's budget. The trials that choose the micro-batch
are ``memory_fit``'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from imgtrainer import torch_compat
from imgtrainer.distributed.setup import memory_share
from imgtrainer.errors import UserError
from imgtrainer.files import format_bytes

log = logging.getLogger(__name__)


# What helps when even one image per forward/backward does not fit.
OOM_HELP = (
    "what would help: --low_memory (float16 and activation checkpointing), a smaller "
    "--image_size, a smaller --model, or more memory (a larger --max_memory_gb, or "
    "closing other programs that use the GPU)"
)


def gib(num_bytes: float) -> str:
    """The budget's unit in the fitting's log lines: "1.50 GiB"."""
    return format_bytes(num_bytes, "GiB", 2)


# ----------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """How each loaded batch goes through the model. Mutable on purpose: the step halves
    ``micro_batch`` when an out-of-memory error forces it, and the trainer stores the value in
    checkpoints and history."""

    micro_batch: int | None = None  # images per forward/backward; None: the whole batch
    retry_on_oom: bool = False  # on out-of-memory, halve and redo the step (ranks agree)
    channels_last: bool = False  # move inputs in channels_last layout (the model is too)
    augment_chunk: int | None = None  # images augmented at a time; None: the loaded batch

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


class BufferSnapshot:
    """A copy of a model's buffers (BatchNorm running statistics). A step that is redone, or a
    trial forward pass, must not leave its samples counted in those statistics."""

    def __init__(self, model: nn.Module):
        self.pairs = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]

    def take(self, model: nn.Module) -> BufferSnapshot:
        """Snapshot ``model``'s buffers again into the same copies (no allocation: one
        ``_foreach_copy_``), or into new ones if its buffers changed."""
        buffers = list(model.buffers())
        same = len(buffers) == len(self.pairs) and all(
            b is old and b.shape == saved.shape and b.dtype == saved.dtype
            for b, (old, saved) in zip(buffers, self.pairs, strict=True)
        )
        if not same:
            self.__init__(model)
        elif buffers:
            with torch.no_grad():
                torch_compat.foreach_copy_([saved for _, saved in self.pairs], buffers)
        return self

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.pairs:
                buffer.copy_(saved)


# ----------------------------------------------------------------------------- model set-up


def enable_memory_savers(
    model: nn.Module, *, grad_checkpointing: bool, channels_last: bool, early_only: bool = False
) -> None:
    """Activation checkpointing and the channels_last layout. Call before DDP wraps the model:
    DDP lays out its buckets from the parameters.

    Checkpointing is timm's ``set_grad_checkpointing`` (every block), or with ``early_only``
    (``--low_memory``) only the early, high-resolution layers where a ResNet keeps most of its
    activations (``checkpoint_early_layers``); models without that split get timm's."""
    if grad_checkpointing and not (early_only and checkpoint_early_layers(model)):
        try:
            model.set_grad_checkpointing(True)
        except (AttributeError, NotImplementedError, AssertionError) as err:
            log.warning(
                f"{type(model).__name__} has no activation checkpointing in "
                f"timm ({err or type(err).__name__}); training without it"
            )
    if channels_last:
        model.to(memory_format=torch.channels_last)


# What ``checkpoint_early_layers`` marks a model with, for the run's memory line.
EARLY_CHECKPOINTING = "_checkpointed_early_layers"


def checkpointing_in_use(model: nn.Module) -> str:
    """How the model checkpoints its activations: "early layers", "every block" or "off"."""
    if getattr(model, EARLY_CHECKPOINTING, False):
        return "early layers"
    return "every block" if getattr(model, "grad_checkpointing", False) else "off"


def checkpoint_early_layers(model: nn.Module) -> bool:
    """Recompute in backward only the stem (up to the max-pool) and the first stage of a timm
    ResNet, False for other models. Those run at 1/2 and 1/4 of the input's side and keep about
    70% of ResNet18's activations; the later stages, which hold most of the FLOPs, keep theirs
    and are not run twice. Timm's own checkpointing keeps the stem's activations and recomputes
    every block."""
    from timm.models.resnet import ResNet

    if not isinstance(model, ResNet):
        return False
    # An instance attribute: timm's forward calls self.forward_features; state_dict keys, DDP,
    # torch.compile and deepcopy (the EMA) see the same module tree.
    model.forward_features = partial(_early_checkpointed_features, model)
    setattr(model, EARLY_CHECKPOINTING, True)
    return True


def _resnet_stem(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.maxpool(model.act1(model.bn1(model.conv1(x))))


def _early_checkpointed_features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    stem = (model.conv1, model.bn1, model.act1, model.maxpool)  # conv1: one or three (deep stem)
    x = _checkpoint(partial(_resnet_stem, model), _batch_norms(*stem), x)
    for block in model.layer1:
        x = _checkpoint(block, _batch_norms(block), x)
    return model.layer4(model.layer3(model.layer2(x)))


def _batch_norms(*modules: nn.Module) -> list[nn.Module]:
    return [m for module in modules for m in module.modules() if torch_compat.is_batch_norm(m)]


def _checkpoint(function, norms: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # evaluation, the EMA's forward: nothing to recompute
        return function(x)
    if torch.compiler.is_compiling():
        # The compiled graph recomputes values only; its running statistics are updated once.
        return checkpoint(function, x, use_reentrant=False)
    recompute = partial(_running_stats_kept, norms)
    return checkpoint(
        function, x, use_reentrant=False, context_fn=lambda: (nullcontext(), recompute())
    )


@contextmanager
def _running_stats_kept(norms: list[nn.Module]) -> Iterator[None]:
    """The recomputation in backward sees the same batch again: BatchNorm must not count it in
    its running statistics a second time (momentum 0 leaves them as they are)."""
    saved = [(m, m.momentum, m.num_batches_tracked.clone()) for m in norms if m.track_running_stats]
    for m, _, _ in saved:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            m.num_batches_tracked.copy_(tracked)


def memory_budget(
    max_memory_gb: float | None, device: torch.device, processes_on_device: int
) -> int:
    """Bytes one process may use: its share of the device's memory (the GPU, or on the CPU the
    RAM) among the ``processes_on_device`` using it, and at most ``--max_memory_gb``."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return memory_share(total, processes_on_device, max_memory_gb)

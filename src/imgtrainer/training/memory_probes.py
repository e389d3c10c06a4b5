"""What a step costs in memory: tensor sizes, resident memory, saved activations."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from imgtrainer.checkpoints.files import tensor_bytes

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


def batch_input_bytes(batch_size: int, image_size: int) -> int:
    """Bytes of one loaded batch's float32 inputs that sit in device memory during its step,
    the same on any device and in either layout.

    The step copies every micro-batch to the device before the first forward (so that an
    out-of-memory error there is agreed on before any collective), so the whole batch is on
    the device, not one micro-batch. On the CPU that is the loaded batch itself. On CUDA every
    source's batch is augmented on the device (``data.device.augment``) straight into the
    model's layout (channels_last or not), so the step's move to its layout copies nothing:
    one copy either way. (The augmentation's own buffers are freed before the step's forward;
    ``memory_fit.plan_augmentation`` counts them.)"""
    return batch_size * 3 * image_size * image_size * 4


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
        more than its trial measured. Costs page faults (a few % on the CPU)."""
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

"""Numeric precision of a run: AMP's dtype, the gradient scaler, the backends' settings.

Also the dtype and memory layout the model and its batches share on a device.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from imgtrainer.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """How the forward pass runs: autocast on or off, and in which dtype."""

    enabled: bool
    dtype: torch.dtype

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=self.dtype, enabled=self.enabled)

    def batch_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the batches handed to the model on ``device``: where CUDA trains under
        autocast, its dtype (bfloat16 or float16), to which the first layer would cast them
        anyway (the same values, half the bytes written and read); float32 otherwise."""
        return self.dtype if self.enabled and device.type == "cuda" else torch.float32


FLOAT32 = Precision(False, torch.float32)


def uses_channels_last(requested: bool, device: torch.device) -> bool:
    """Whether the model and its batches are channels_last in memory: where asked for
    (--channels_last) and on CUDA, whose tensor-core convolutions want it."""
    return requested and torch.device(device).type == "cuda"


def configure_backends(device: torch.device, deterministic: bool) -> None:
    """The kernel choices of a run, shared by the trainer and the benchmarks (whose figures must
    be the trainer's). Call before the first CUDA computation."""
    if device.type == "cuda":
        # cudnn.benchmark picks the fastest kernels, which may differ from run to run.
        torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def choose_precision(cfg: TrainConfig, device: torch.device) -> Precision:
    """The run's autocast (``precision_rule``), saying why when the CPU changes the choice."""
    if cfg.use_amp and device.type == "cpu":
        if cfg.low_memory:
            log.info(
                "--low_memory on the CPU: training in float32 "
                "(bfloat16 autocast is much slower there)"
            )
        else:
            log.warning(
                "--use_amp on the CPU uses bfloat16 autocast, which is usually "
                "slower than float32 there"
            )
    return precision_rule(cfg.use_amp, cfg.low_memory, cfg.amp_dtype, device)


def precision_rule(
    use_amp: bool, low_memory: bool, amp_dtype: str, device: torch.device
) -> Precision:
    """The one precision rule, for training and for the tools that replay its evaluation:
    float32 without --use_amp; on the CPU bfloat16, or float32 under --low_memory (bfloat16
    autocast is much slower there, and the micro-batches already bound the memory)."""
    if not use_amp or (device.type == "cpu" and low_memory):
        return FLOAT32
    if device.type == "cpu":
        return Precision(True, torch.bfloat16)
    return Precision(True, getattr(torch, amp_dtype))


def make_grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling is needed for float16 only: bfloat16 has float32's exponent range."""
    return torch.amp.GradScaler(
        device.type, enabled=precision.enabled and precision.dtype == torch.float16
    )

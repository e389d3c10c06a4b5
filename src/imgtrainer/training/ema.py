"""An exponential moving average (EMA) of the model's weights, kept by a per-step hook.

timm's ``ModelEmaV3`` does the arithmetic (parameters and BatchNorm statistics averaged, integer
buffers copied). ``ModelEma`` counts the updates, which the warm-up
``decay(n) = min(ema_decay, 1 - n ** -0.75)`` reads and a checkpoint stores (``ema_updates``), so a
resumed run continues the same average bitwise. Only steps the optimizer took update it
(docs/training.md: EMA of the weights).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from timm.utils import ModelEmaV3
from torch import nn

from imgtrainer.hooks import Hook

log = logging.getLogger(__name__)


WARMUP_POWER = 0.75


# The history keys of the EMA's evaluation: engine.evaluate's keys with this suffix.
EMA_SUFFIX = "_ema"


VAL_KEYS = ("val_loss", "val_acc", "val_top5")


def ema_decay(update: int, cap: float) -> float:
    """The decay of the ``update``-th update (1-based): ``min(cap, 1 - update ** -0.75)``."""
    return min(cap, 1.0 - update**-WARMUP_POWER) if update > 1 else 0.0


class ModelEma(Hook):
    """The EMA of ``model``'s weights and buffers as a step hook (``imgtrainer.hooks.Hook``): updated
    after every optimizer step that was taken. Built with ``model=None`` it is disabled and
    does nothing.

    Under DDP every rank keeps its own EMA of the same weights (identical on every rank, so the
    averages are too), because every rank evaluates its shard with it. Only the BatchNorm
    statistics differ between ranks (each rank's come from its own batches, as for the model
    itself): ``distributed.broadcast_buffers`` gives every rank rank 0's before evaluation,
    and rank 0's are the ones saved.
    """

    def __init__(self, model: nn.Module | None, decay: float = 0.999):
        self.source = model  # the plain (unwrapped) model whose weights are averaged
        self.decay = decay
        self.updates = 0  # updates done: the warm-up's position
        self._ema: ModelEmaV3 | None = None
        if model is not None:
            # A copy of the model as it is now (device, dtype, memory layout); its weights are
            # replaced by the first update.
            self._ema = ModelEmaV3(model, decay=decay, use_warmup=True, warmup_power=WARMUP_POWER)
            self._ema.module.requires_grad_(False)  # never trained: no autograd bookkeeping

    @property
    def enabled(self) -> bool:
        return self._ema is not None

    @property
    def module(self) -> nn.Module:
        """The averaged model (in eval mode), to evaluate or save."""
        if self._ema is None:
            raise RuntimeError("the EMA is disabled (--model_ema is off)")
        return self._ema.module

    @torch.no_grad()
    def update(self) -> None:
        """One more step into the average (after an optimizer step that was taken)."""
        self.updates += 1
        # timm's decay of this update (``get_decay``): ``ema_decay(self.updates, self.decay)``.
        self._ema.update(self.source, step=self.updates)

    def on_step_end(self, info: Any) -> bool:
        """Update when the step was taken (reading ``info.taken`` waits
        for the device only under float16 loss scaling)."""
        if self._ema is not None and info.taken:
            self.update()
        return False

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The averaged weights with the plain model's keys, or None when disabled."""
        return self.module.state_dict() if self._ema is not None else None

    def resume(self, checkpoint: Mapping[str, Any]) -> None:
        """Continue the average a checkpoint holds; call after the model's own weights were
        loaded. A checkpoint without one (trained without --model_ema) starts the average from
        the resumed weights."""
        saved = checkpoint.get("model_ema_state_dict")
        if self._ema is None:
            if saved is not None:
                log.info("The checkpoint's EMA weights are not continued (--model_ema is off)")
            return
        if saved is None:
            self._ema.set(self.source)
            self.updates = 0
            log.info("--model_ema: the checkpoint holds no EMA; it starts from the resumed weights")
            return
        self.module.load_state_dict(saved)
        self.updates = int(checkpoint.get("ema_updates") or 0)


def record_metrics(val: Mapping[str, float]) -> dict[str, float]:
    """The validation metrics a history record keeps: ``VAL_KEYS`` (when validated), then the
    EMA's."""
    return {
        **{key: val[key] for key in VAL_KEYS if key in val},
        **{key: value for key, value in val.items() if key.endswith(EMA_SUFFIX)},
    }


def ema_metrics(val: Mapping[str, float]) -> dict[str, float]:
    """``engine.evaluate``'s metrics of the EMA weights, under the history's EMA keys."""
    return {f"{key}{EMA_SUFFIX}": val[key] for key in VAL_KEYS}

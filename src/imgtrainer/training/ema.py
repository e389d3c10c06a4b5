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

from imgtrainer import torch_compat
from imgtrainer.hooks import Hook

log = logging.getLogger(__name__)


WARMUP_POWER = 0.75


# The history keys of the EMA's evaluation: training.evaluation.evaluate's keys with this suffix.
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
        self._ema: ModelEmaV3 | None = None
        self._state: tuple[list, list, list] | None = None  # ``_paired_state``, made once
        # Updates done (the warm-up's position), on the device; ``updates`` reads it.
        self._count = torch.zeros((), dtype=torch.int64)
        self._bound = 0  # known on the host: the count is at most this
        self._tables: dict[torch.dtype, torch.Tensor] = {}
        self._spread: list[torch.Tensor] | None = None  # the skip path's weights, made once
        self._spread_buffers: list[torch.Tensor] = []  # the one buffer per dtype they view
        if model is not None:
            # A copy of the model as it is now (device, dtype, memory layout); its weights are
            # replaced by the first update.
            self._ema = ModelEmaV3(model, decay=decay, use_warmup=True, warmup_power=WARMUP_POWER)
            self._ema.module.requires_grad_(False)  # never trained: no autograd bookkeeping
            device = next(iter(self._ema.module.state_dict().values()), self._count).device
            self._count = self._count.to(device)

    @property
    def updates(self) -> int:
        """Updates done: the warm-up's position (reading it waits for the device)."""
        return int(self._count.item())

    @updates.setter
    def updates(self, value: int) -> None:
        self._count.fill_(value)
        self._bound = value

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
    def update(self, skipped: torch.Tensor | None = None) -> None:
        """One more step into the average, unless the device flag ``skipped`` is set (the
        GradScaler skipped the optimizer step). Without one, the count is known here and the
        update is timm's own call, one multi-tensor lerp with the weight as a Python number.
        With one, it is decided on the device, never read here (no host synchronisation): the
        count lives in a device tensor, each update's weight ``1 - decay(n)`` comes from a
        device table of the Python numbers timm computes, times ``taken``, spread over weight
        tensors shaped like the state (a multi-tensor lerp takes them; 0-d weights would make
        it one launch per tensor); a skipped step lerps with weight 0 (every value unchanged,
        up to the sign of an exact zero), copies no integer buffer and does not advance the
        count."""
        if self._state is None:  # the same tensors every step: loads copy into them in place
            self._state = self._paired_state()
        ema_values, model_values, counters = self._state
        taken = None if skipped is None else ~skipped.to(self._count.device)
        if ema_values and taken is None:
            weight = 1.0 - self._ema.get_decay(self._bound + 1)
            torch_compat.foreach_lerp_(ema_values, model_values, weight)
        elif ema_values:
            torch_compat.foreach_lerp_(ema_values, model_values, self._spread_weights(taken))
        if counters:  # integer buffers (BatchNorm's batch counter): copied when taken
            ema_ints, model_ints = (list(c) for c in zip(*counters, strict=True))
            if taken is None:
                torch_compat.foreach_copy_(ema_ints, model_ints)
            else:
                change = torch_compat.foreach_sub(model_ints, ema_ints)
                torch_compat.foreach_mul_(change, taken.long())
                torch_compat.foreach_add_(ema_ints, change)
        self._count += 1 if taken is None else taken.long()
        self._bound += 1

    def _spread_weights(self, taken: torch.Tensor) -> list[torch.Tensor]:
        """This update's weight (``_weight``, 0 when not ``taken``) in tensors shaped and laid
        out like each state value: views into one buffer per dtype, made once and filled by one
        broadcast copy each (a 0-d tensor given to ``_foreach_add_`` is read as a Python number:
        a host synchronisation)."""
        if self._spread is None:
            self._spread, self._spread_buffers = _views_like(self._state[0])
        for flat in self._spread_buffers:
            flat.copy_(self._weight(flat.dtype, taken).expand_as(flat))
        return self._spread

    def _paired_state(self) -> tuple[list, list, list]:
        """The EMA's and the model's floating-point state tensors, side by side, and the pairs of
        integer buffers."""
        ema_values, model_values, counters = [], [], []
        for ema_v, model_v in zip(
            self._ema.module.state_dict().values(), self.source.state_dict().values(), strict=True
        ):
            if ema_v.is_floating_point():
                ema_values.append(ema_v)
                model_values.append(model_v)
            else:
                counters.append((ema_v, model_v))
        return ema_values, model_values, counters

    def _weight(self, dtype: torch.dtype, taken: torch.Tensor | None) -> torch.Tensor:
        """This update's weight, a 0-d ``dtype`` tensor on the device: the table's entry at the
        count (its last entry once the decay reached its cap), times ``taken``."""
        table = self._tables.get(dtype)
        if table is None or (len(table) <= self._bound and not self._capped(len(table))):
            table = self._tables[dtype] = self._weight_table(dtype)
        index = self._count.clamp(max=len(table) - 1).view(1)
        weight = table.index_select(0, index).view(())
        return weight if taken is None else weight * taken

    def _capped(self, length: int) -> bool:
        """Whether the decay of update ``length`` (and every later one) is the cap."""
        return self._ema.get_decay(length) == self.decay

    def _weight_table(self, dtype: torch.dtype) -> torch.Tensor:
        """``1 - get_decay(n + 1)`` at index n, in ``dtype`` (what the lerp kernel makes of
        timm's Python float), until the decay reaches its cap or past the count's bound."""
        # At once up to the cap where that is at most 2^18 entries (--ema_decay up to 0.9999),
        # else doubled as the count grows: each new table is one host-to-device copy.
        length = 1024
        while not self._capped(length) and (length <= self._bound or length < 2**18):
            length *= 2
        values = [1.0 - self._ema.get_decay(n + 1) for n in range(length)]
        return torch.tensor(values, dtype=dtype).to(self._count.device, non_blocking=True)

    def on_step_end(self, info: Any) -> bool:
        """Update, on the device, unless the GradScaler skipped the step (no host wait)."""
        if self._ema is not None:
            self.update(info._skipped)
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


def history_val_metrics(val: Mapping[str, float]) -> dict[str, float]:
    """The validation metrics a history record keeps: ``VAL_KEYS`` (when validated), then the
    EMA's."""
    return {
        **{key: val[key] for key in VAL_KEYS if key in val},
        **{key: value for key, value in val.items() if key.endswith(EMA_SUFFIX)},
    }


def ema_metrics(val: Mapping[str, float]) -> dict[str, float]:
    """``training.evaluation.evaluate``'s metrics of the EMA weights, under the history's EMA keys."""
    return {f"{key}{EMA_SUFFIX}": val[key] for key in VAL_KEYS}


def _views_like(values: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Tensors with each value's size and strides (a multi-tensor op's fast path wants them
    alike), all viewing one flat buffer per dtype and device, and those buffers."""
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for value in values:
        sizes[value.dtype, value.device] = sizes.get((value.dtype, value.device), 0) + value.numel()
    buffers = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
    offsets = dict.fromkeys(buffers, 0)
    views = []
    for value in values:
        key = (value.dtype, value.device)
        # a state value is dense: its storage spans its numel, whatever its strides
        views.append(buffers[key].as_strided(value.size(), value.stride(), offsets[key]))
        offsets[key] += value.numel()
    return views, list(buffers.values())

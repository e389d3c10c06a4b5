"""Stopping a run whose loss is no longer finite, before it saves non-finite weights.

Consecutive non-finite losses are counted on the device; the host reads the count at the
logging steps (one logging step late, copied without waiting), at the epoch's end and before
every checkpoint, and all ranks agree on it. A step the
float16 GradScaler skips has a finite loss and does not count. Checkpoints are also refused
when the weights themselves are not finite.
"""

from __future__ import annotations

import torch

from imgtrainer.checkpoints.writer import CAUSES
from imgtrainer.distributed.collectives import all_reduce, host_group
from imgtrainer.errors import RunFailed
from imgtrainer.training.host_copy import HostCopy

# Consecutive optimizer steps with a non-finite loss that stop the run: one such step (a float16
# overflow the GradScaler then skips) can pass; weights that became NaN make every later loss NaN.
NONFINITE_STEPS = 3


class NonFiniteLoss:
    """The loop's per-step record of non-finite losses; ``check`` raises ``RunFailed`` on every
    rank once any rank had ``NONFINITE_STEPS`` in a row."""

    def __init__(self, device: torch.device, distributed: bool, steps: int = NONFINITE_STEPS):
        self.steps, self.distributed = steps, distributed
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        self._late: HostCopy | None = None  # first_bad, copied for the lagged checks

    def update(self, loss_sum: torch.Tensor, global_step: int) -> None:
        """After optimizer step ``global_step`` (1-based) with this loss (any scale): device
        operations only."""
        bad = (~torch.isfinite(loss_sum)).to(torch.int64)
        self.streak.mul_(bad).add_(bad)
        tripped = (self.streak == self.steps) & (self.first_bad < 0)
        self.first_bad.copy_(torch.where(tripped, global_step - self.steps + 1, self.first_bad))

    def check(self, steps_per_epoch: int, lagged: bool = False) -> None:
        """Every rank must call this at the same points: it reads the device and, under
        torch.distributed, agrees over the host group. ``lagged``: read the value copied at
        the previous lagged check (none yet: nothing found) and start copying this one, so
        the host does not wait for the device."""
        if lagged:
            self._late = self._late or HostCopy(self.first_bad)
            previous = self._late.read()
            self._late.start(self.first_bad)
            first = -1 if previous is None else int(previous)
        else:
            first = int(self.first_bad.item())
        rank = torch.distributed.get_rank() if self.distributed else 0
        if self.distributed:
            world = torch.distributed.get_world_size()
            # The earliest step on any rank, and the lowest rank that had it.
            code = torch.tensor(
                [first * world + rank if first >= 0 else torch.iinfo(torch.int64).max]
            )
            code = int(all_reduce(code, "min", group=host_group()).item())
            if code == torch.iinfo(torch.int64).max:
                return
            first, rank = divmod(code, world)
        elif first < 0:
            return
        epoch, step = divmod(first - 1, steps_per_epoch)
        raise RunFailed(
            f"the training loss was not finite (NaN or inf) for {self.steps} optimizer steps "
            f"in a row from step {first} (epoch {epoch + 1}, step {step + 1} of "
            f"{steps_per_epoch}) on rank {rank}; stopped before saving anything from it. "
            f"{CAUSES}; --resume auto continues from the last checkpoint saved before it, if any"
        )

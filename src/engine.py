"""One training epoch and one evaluation pass. They know nothing about ranks or files.

Metrics are accumulated as sums on the device (no host synchronisation inside the step, except
the progress-bar update every ``log_interval`` steps) and summed across ranks with
``all_reduce_sum`` at the end, so they are exact, never averages of averages.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from distributed import all_reduce_sum

# Index of each running sum in the metric tensors.
LOSS, CORRECT, COUNT = 0, 1, 2          # training: [loss_sum, correct, count]
TOP5 = 3                                # evaluation adds correct-in-top-5


@dataclass(frozen=True)
class Precision:
    """How the forward pass runs: autocast on or off, and in which dtype."""
    enabled: bool
    dtype: torch.dtype

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=self.dtype, enabled=self.enabled)


class PhaseTimer:
    """Wall time spent in each phase of the training step, for the throughput benchmark.

    Disabled (the default) it costs one attribute check per phase. On CUDA, pass
    ``synchronize=torch.cuda.synchronize`` so each phase's kernels are counted in that phase;
    that removes the overlap between phases, so time whole runs without the timer.
    """

    def __init__(self, enabled: bool = False, synchronize: Callable[[], None] | None = None):
        self.enabled = enabled
        self.synchronize = synchronize or (lambda: None)
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self.synchronize()
        start = time.perf_counter()
        yield
        self.synchronize()
        self.seconds[name] += time.perf_counter() - start

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return self._timed(name) if self.enabled else contextlib.nullcontext()

    def iterate(self, batches: Iterable, name: str = "data_wait") -> Iterator:
        """Yield from ``batches``, counting the time spent waiting for each one."""
        iterator = iter(batches)
        while True:
            with self.phase(name):
                batch = next(iterator, None)
            if batch is None:
                return
            yield batch


NO_TIMER = PhaseTimer(enabled=False)

# Called after every optimizer step with (steps done in this epoch, this rank's running sums);
# returns True when the epoch must stop there (a preemption signal).
StepCallback = Callable[[int, torch.Tensor], bool]


def train_one_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler,
                    scaler: torch.amp.GradScaler, criterion: nn.Module, device: torch.device,
                    precision: Precision, *, start_step: int = 0,
                    sums: torch.Tensor | None = None, show_progress: bool = True,
                    log_interval: int = 20, description: str = "train",
                    on_step_end: StepCallback | None = None,
                    timer: PhaseTimer = NO_TIMER) -> dict[str, float]:
    """Train over ``loader`` (which already skips the ``start_step`` batches done before a
    resume); ``sums`` carries the running metrics of those batches."""
    model.train()
    sums = torch.zeros(3, dtype=torch.float64, device=device) if sums is None else sums.to(device)
    step = start_step
    bar = tqdm(loader, total=start_step + len(loader), initial=start_step, desc=description,
               disable=not show_progress, dynamic_ncols=True, leave=False)
    for images, targets in timer.iterate(bar):
        with timer.phase("forward_backward"):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with precision.autocast(device):
                logits = model(images)
                loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
        with timer.phase("optimizer"):
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
        step += 1

        with timer.phase("metrics_and_hooks"):
            with torch.no_grad():
                sums[LOSS] += loss.detach().double() * targets.size(0)
                sums[CORRECT] += (logits.argmax(dim=1) == targets).sum()
                sums[COUNT] += targets.size(0)
            if show_progress and step % log_interval == 0:
                bar.set_postfix(loss=f"{sums[LOSS].item() / sums[COUNT].item():.4f}",
                                acc=f"{sums[CORRECT].item() / sums[COUNT].item():.4f}",
                                lr=f"{optimizer.param_groups[0]['lr']:.2e}")
            stop = on_step_end is not None and on_step_end(step, sums)
        if stop:
            break
    bar.close()

    total = all_reduce_sum(sums.clone()).tolist()
    return {"train_loss": total[LOSS] / max(total[COUNT], 1),
            "train_acc": total[CORRECT] / max(total[COUNT], 1),
            "train_samples": int(total[COUNT]), "steps": step}


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, precision: Precision,
             show_progress: bool = True) -> dict[str, float]:
    """Loss, top-1 and top-5 over this rank's shard, summed over all ranks.

    Every rank must call this (the final all-reduce is a collective). Shards are uneven by at
    most one image, which is fine: ``model`` is the unwrapped module, so the forward passes run
    no collectives and no rank waits for another inside the loop.
    """
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for images, targets in tqdm(loader, desc="val", disable=not show_progress,
                                dynamic_ncols=True, leave=False):
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with precision.autocast(device):
            logits = model(images)
        k = min(5, logits.size(1))
        top = logits.topk(k, dim=1).indices
        sums[LOSS] += F.cross_entropy(logits.float(), targets, reduction="sum").double()
        sums[CORRECT] += (top[:, 0] == targets).sum()
        sums[TOP5] += (top == targets[:, None]).any(dim=1).sum()
        sums[COUNT] += targets.size(0)
    total = all_reduce_sum(sums).tolist()
    count = max(total[COUNT], 1)
    return {"val_loss": total[LOSS] / count, "val_acc": total[CORRECT] / count,
            "val_top5": total[TOP5] / count, "val_samples": int(total[COUNT])}

"""One training epoch: the loop over the loader, calling its hooks after each step.

Its hooks (``imgtrainer.hooks``) run after each step and at logging steps; the progress bar is
its first hook.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from imgtrainer import heartbeat
from imgtrainer.distributed.collectives import all_reduce_sum, world_size
from imgtrainer.distributed.logs import console_is_terminal
from imgtrainer.hooks import Hook, Hooks, StepInfo
from imgtrainer.torch_compat import check_ddp_internals
from imgtrainer.training.host_copy import HostCopy
from imgtrainer.training.nonfinite import NonFiniteLoss
from imgtrainer.training.step import (
    CORRECT,
    COUNT,
    LOSS,
    RunParts,
    ddp_of,
    train_step,
)
from imgtrainer.training.stragglers import RankClock

log = logging.getLogger(__name__)


class ProgressBar(Hook):
    """tqdm over the loader, with the running metrics at logging steps, where the console is a
    terminal. Elsewhere (SLURM, nohup, ``> train.log``) a redrawn bar would pile up carriage
    returns on one line, so each logging step is one plain log line instead. Disabled, it shows
    nothing and its ``on_log_step`` does nothing."""

    def __init__(self, enabled: bool, description: str = "train", terminal: bool | None = None):
        self.enabled, self.description = enabled, description
        # Where tqdm draws (the launcher points the main rank's stderr at its stdout).
        self.terminal = console_is_terminal() if terminal is None else terminal
        self.bar: tqdm | None = None
        self.done, self.total = 0, 0
        self.step_offset: int | None = None  # epoch step - global step, where known

    def wrap(self, loader, start_step: int, first_global_step: int | None = None) -> Iterable:
        self.done, self.total = start_step, start_step + len(loader)
        if first_global_step is not None:
            self.step_offset = start_step - first_global_step
        if not self.terminal:
            return self._counted(loader)
        self.bar = tqdm(
            loader,
            total=self.total,
            initial=start_step,
            desc=self.description,
            disable=not self.enabled,
            dynamic_ncols=True,
            leave=False,
        )
        return self.bar

    def _counted(self, loader) -> Iterator:
        for batch in loader:
            self.done += 1
            yield batch

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{metrics['train_loss']:.4f}",
                acc=f"{metrics['train_acc']:.4f}",
                lr=f"{metrics['lr']:.2e}",
            )
        elif not self.terminal:
            # The metrics are those of that step (one logging step late): name it, not the
            # step the loop is at.
            step = self.done if self.step_offset is None else global_step + self.step_offset
            log.info(
                f"{self.description} step {step}/{self.total}  "
                f"loss {metrics['train_loss']:.4f}  acc {metrics['train_acc']:.4f}  "
                f"lr {metrics['lr']:.2e}  {metrics['images_per_sec']:.0f} img/s"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LogWindow:
    """Host clocks over the steps since the last logging step: images per second (all ranks)
    and the share of the wall time spent waiting for the next batch. The metrics are read one
    logging step late (``HostCopy``), so the host may run up to one window ahead of the device;
    over many windows the rates are the device's."""

    def __init__(self):
        self.started = time.perf_counter()
        self.waited = self.last_wait = 0.0
        self.epoch_waited = 0.0  # over the whole epoch, for its record
        self.images = 0

    def timed(self, batches: Iterable) -> Iterator:
        iterator = iter(batches)
        while True:
            before = time.perf_counter()
            batch = next(iterator, None)
            self.last_wait = time.perf_counter() - before
            self.waited += self.last_wait
            self.epoch_waited += self.last_wait
            if batch is None:
                return
            yield batch

    def read(self) -> dict[str, float]:
        """The window's figures; starts the next window."""
        now = time.perf_counter()
        seconds = max(now - self.started, 1e-9)
        figures = {
            "images_per_sec": self.images * world_size() / seconds,
            "data_wait_share": min(self.waited / seconds, 1.0),
        }
        self.started, self.waited, self.images = now, 0.0, 0
        return figures


class LaggedLog:
    """The logging step's metrics, one logging step late: at each logging step the running
    sums are copied to the host without waiting, and the previous logging step's copy is
    reported, with the step, learning rate and clocks of that step. ``flush`` at the epoch's
    end reports the last one (the epoch's end synchronises anyway)."""

    def __init__(self, sums: torch.Tensor, hooks: Hooks):
        self.copy, self.hooks = HostCopy(sums), hooks
        self.pending: tuple[int, dict[str, float]] | None = None

    def log_step(self, global_step: int, sums: torch.Tensor, host_figures: dict) -> None:
        self.flush()
        self.copy.start(sums)
        self.pending = (global_step, host_figures)

    def flush(self) -> None:
        values = self.copy.read()
        if values is None or self.pending is None:
            return
        (global_step, figures), self.pending = self.pending, None
        count = values[COUNT]
        metrics = {
            "train_loss": values[LOSS] / count,
            "train_acc": values[CORRECT] / count,
            **figures,
        }
        self.hooks.call("on_log_step", global_step, metrics)


@dataclass
class EpochPlan:
    """What one call of ``train_one_epoch`` needs besides the step state and the loader."""

    start_step: int = 0  # batches done before a resume: the loader already skips them
    first_global_step: int = 0  # the run's step count at the epoch's first batch
    sums: torch.Tensor | None = None  # the running metrics of the batches done
    log_interval: int = 20
    # mixup/cutmix (``mixing.EpochMixer``): mixed images and soft targets of a batch, given
    # the batch's index in the epoch
    mixer: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = (
        None
    )
    # Stops the run (every rank) on losses that are no longer finite; checked at the logging
    # steps and at the end of the epoch
    nonfinite: NonFiniteLoss | None = None
    # This rank's clocks for the straggler watch (``stragglers.RankClock``)
    clock: RankClock | None = None


def train_one_epoch(
    state: RunParts,
    loader,
    *,
    hooks: Iterable[Hook] = (),
    progress: ProgressBar | None = None,
    epoch: EpochPlan | None = None,
) -> dict[str, float]:
    """Train over ``loader`` as ``epoch`` says; ``progress`` wraps the loader and runs as the
    first hook."""
    epoch = epoch or EpochPlan()
    start_step, first_global_step, mixer = epoch.start_step, epoch.first_global_step, epoch.mixer
    sums = _start_epoch(state, epoch.sums)
    progress = progress or ProgressBar(enabled=False)
    hooks = Hooks([progress, *hooks])
    # Only hooks that want the logging step make it copy the metrics to the host; they see
    # each logging step's metrics at the next one (or the epoch's end): no host wait per step.
    log_hooks = hooks.implementing("on_log_step")
    lagged = LaggedLog(sums, log_hooks) if log_hooks else None
    flush_logs = lagged.flush if lagged is not None else (lambda: None)
    nonfinite = epoch.nonfinite
    steps_per_epoch = start_step + len(loader)
    step = start_step
    window = LogWindow()
    clock = epoch.clock or RankClock()
    clock.reset()  # the time since the last agreement (validation, a checkpoint) is no step's
    heartbeat.mark(heartbeat.Phase.DATA, first_global_step)
    for images, targets in window.timed(progress.wrap(loader, start_step, first_global_step)):
        heartbeat.mark(heartbeat.Phase.STEP)
        if mixer is not None:  # the whole optimizer batch, before any split into micro-batches
            images, targets = mixer(images, targets, step)
        started = time.perf_counter()
        step_sums, skipped = train_step(state, images, targets)
        clock.step_done(time.perf_counter() - started, window.last_wait)
        sums += step_sums
        state.scheduler.step()
        step += 1
        window.images += len(targets)
        global_step = first_global_step + step - start_step
        if nonfinite is not None:
            nonfinite.update(step_sums[LOSS], global_step)
            if step % epoch.log_interval == 0:  # read one logging step late
                nonfinite.check(steps_per_epoch, lagged=True)
        if lagged is not None and step % epoch.log_interval == 0:
            lr = state.optimizer.param_groups[0]["lr"]
            lagged.log_step(global_step, sums, {"lr": lr, **window.read()})
        info = StepInfo(step, global_step, sums, skipped, flush_logs=flush_logs)
        if any(hooks.call("on_step_end", info)):
            break
        heartbeat.mark(heartbeat.Phase.DATA, global_step)  # waiting for the next batch
    if lagged is not None:
        lagged.flush()
    progress.close()
    if nonfinite is not None:
        nonfinite.check(steps_per_epoch)
    return {**_epoch_metrics(sums, step, state.plan.micro_batch), "data_wait": window.epoch_waited}


def _start_epoch(state: RunParts, sums: torch.Tensor | None) -> torch.Tensor:
    """The model in training mode, and the epoch's running sums on the device: a resumed
    epoch's, or zeros. With the out-of-memory retry, DDP's internals that it resets are checked
    here, before the first step rather than at the first out-of-memory error."""
    state.model.train()
    if state.plan.retry_on_oom:
        check_ddp_internals(ddp_of(state.model))
    if sums is None:
        return torch.zeros(3, dtype=torch.float64, device=state.device)
    return sums.to(state.device)


def _epoch_metrics(sums: torch.Tensor, steps: int, micro_batch: int | None) -> dict[str, float]:
    """The epoch's training metrics over every rank (a collective: every rank calls it)."""
    total = all_reduce_sum(sums.clone()).tolist()
    return {
        "train_loss": total[LOSS] / max(total[COUNT], 1),
        "train_acc": total[CORRECT] / max(total[COUNT], 1),
        "train_samples": int(total[COUNT]),
        "steps": steps,
        "micro_batch": micro_batch,
    }

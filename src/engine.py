"""One training epoch and one evaluation pass. They know nothing about ranks or files.

Metrics are accumulated as sums on the device (no host synchronisation inside the step, except
the logging step every ``log_interval`` steps, when a hook wants it) and summed across ranks
with ``all_reduce_sum`` at the end, so they are exact, never averages of averages.

``train_one_epoch`` takes the step's state as one ``StepState`` and calls its hooks at named
points (``StepHook``): after each step, at a logging step; the trainer calls ``on_epoch_end``.
Checkpoints, the stop check, the progress bar, EMA and loggers are hooks, not loop edits.

Each loaded batch is one optimizer step (with ``--accum_steps K``, K batches of ``--batch_size``
loaded as one). A ``MemoryPlan`` splits it into micro-batches (``--batch_size`` images, or fewer
when fitting says so): their losses are weighted by their share of the batch, so the accumulated
gradient is the whole batch's, and DDP exchanges gradients once, on the last micro-batch. The
loader still yields whole batches, so sample order and resuming do not depend on the split.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from distributed import all_reduce_sum, any_rank, world_size
from memory import BufferSnapshot, MemoryPlan, is_out_of_memory, release_memory

log = logging.getLogger(f"trainer.{__name__}")  # under the project logger

# Index of each running sum in the metric tensors.
LOSS, CORRECT, COUNT = 0, 1, 2  # training: [loss_sum, correct, count]
TOP5 = 3  # evaluation adds correct-in-top-5


@dataclass(frozen=True)
class Precision:
    """How the forward pass runs: autocast on or off, and in which dtype."""

    enabled: bool
    dtype: torch.dtype

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=self.dtype, enabled=self.enabled)


def configure_backends(device: torch.device, deterministic: bool) -> None:
    """The kernel choices of a run, shared by the trainer and the benchmarks (whose figures must
    be the trainer's). Call before the first CUDA computation."""
    if device.type == "cuda":
        # cudnn.benchmark picks the fastest kernels, which may differ from run to run.
        torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


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


@dataclass
class StepState:
    """Everything a training step works with, built once per run (``run_parts.build_run_parts``)."""

    model: nn.Module  # as trained: DDP and/or compiled
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    precision: Precision
    plan: MemoryPlan  # the micro-batch; halved on out-of-memory if it allows
    device: torch.device
    clip_grad_norm: float = 0.0  # max total gradient norm per optimizer step; 0: off


@dataclass
class StepInfo:
    """What the ``on_step_end`` hooks see after each loaded batch's optimizer step."""

    step: int  # optimizer steps done in this epoch, this one included
    global_step: int  # since the start of the run
    sums: torch.Tensor  # this rank's running [loss_sum, correct, count] of the epoch
    _skipped: torch.Tensor | None = None  # on the device: the GradScaler skipped the step

    @property
    def taken(self) -> bool:
        """False when the GradScaler skipped the step (float16 overflow). Reading it waits for
        the device, so only hooks that care (EMA) should."""
        return self._skipped is None or not bool(self._skipped.item())


class StepHook:
    """Per-step work hangs off three points of the loop. Every method is optional (the loop
    looks each one up), so any object with some of them is a hook; this class documents them.
    A hook that has no job on this rank is built disabled and does nothing.
    """

    def on_step_end(self, info: StepInfo) -> bool:
        """After every loaded batch's optimizer step (``info.taken``: not skipped by the
        GradScaler). True stops the epoch there (a preemption signal)."""
        return False

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        """Every ``log_interval`` steps, with the running train_loss, train_acc and lr already
        read as Python floats (one host synchronisation for all hooks)."""

    def on_epoch_end(self, epoch: int, record: dict) -> None:
        """After an epoch's evaluation, with its history record (called by the trainer)."""


def call_hooks(hooks: Iterable, name: str, *args) -> list:
    """Call ``name`` on each hook that has it; returns their results."""
    return [getattr(hook, name)(*args) for hook in hooks if hasattr(hook, name)]


class ProgressBar:
    """tqdm over the loader, with the running metrics at logging steps; disabled, it shows
    nothing (tqdm's own no-op) and its ``on_log_step`` does nothing."""

    def __init__(self, enabled: bool, description: str = "train"):
        self.enabled, self.description = enabled, description
        self.bar: tqdm | None = None

    def wrap(self, loader, start_step: int) -> Iterable:
        self.bar = tqdm(
            loader,
            total=start_step + len(loader),
            initial=start_step,
            desc=self.description,
            disable=not self.enabled,
            dynamic_ncols=True,
            leave=False,
        )
        return self.bar

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        if self.enabled and self.bar is not None:
            self.bar.set_postfix(
                loss=f"{metrics['train_loss']:.4f}",
                acc=f"{metrics['train_acc']:.4f}",
                lr=f"{metrics['lr']:.2e}",
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LogWindow:
    """Host clocks over the steps since the last logging step: images per second (all ranks)
    and the share of the wall time spent waiting for the next batch. Reading the metrics at a
    logging step synchronises with the device, so each window's wall time is the real one; no
    other synchronisation is added."""

    def __init__(self):
        self.started = time.perf_counter()
        self.waited = 0.0
        self.images = 0

    def timed(self, batches: Iterable) -> Iterator:
        iterator = iter(batches)
        while True:
            before = time.perf_counter()
            batch = next(iterator, None)
            self.waited += time.perf_counter() - before
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


def train_one_epoch(
    state: StepState,
    loader,
    *,
    hooks: Sequence = (),
    progress: ProgressBar | None = None,
    start_step: int = 0,
    first_global_step: int = 0,
    sums: torch.Tensor | None = None,
    log_interval: int = 20,
    timer: PhaseTimer = NO_TIMER,
    mixer: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    | None = None,
) -> dict[str, float]:
    """Train over ``loader`` (which already skips the ``start_step`` batches done before a
    resume); ``sums`` carries the running metrics of those batches; ``first_global_step`` is
    the run's step count at the epoch's first batch (for the hooks). ``mixer`` (mixup/cutmix,
    ``mixing.EpochMixer``) turns each batch into mixed images and soft targets, given the
    batch's index in the epoch."""
    state.model.train()
    device, plan = state.device, state.plan
    if plan.retry_on_oom:
        check_ddp_internals(_ddp(state.model))  # before the first step, not at the first OOM
    sums = torch.zeros(3, dtype=torch.float64, device=device) if sums is None else sums.to(device)
    progress = progress or ProgressBar(enabled=False)
    # Only hooks that want the logging step make it read the metrics (a host synchronisation).
    log_hooks = [
        h for h in (progress, *hooks) if hasattr(h, "on_log_step") and getattr(h, "enabled", True)
    ]
    step = start_step
    window = LogWindow()
    for images, targets in window.timed(timer.iterate(progress.wrap(loader, start_step))):
        if mixer is not None:  # the whole optimizer batch, before any split into micro-batches
            with timer.phase("mixing"):
                images, targets = mixer(images, targets, step)
        step_sums, skipped = train_step(state, images, targets, timer)
        sums += step_sums
        state.scheduler.step()
        step += 1
        window.images += len(targets)
        with timer.phase("metrics_and_hooks"):
            global_step = first_global_step + step - start_step
            if log_hooks and step % log_interval == 0:
                count = sums[COUNT].item()
                metrics = {
                    "train_loss": sums[LOSS].item() / count,
                    "train_acc": sums[CORRECT].item() / count,
                    "lr": state.optimizer.param_groups[0]["lr"],
                    **window.read(),
                }
                call_hooks(log_hooks, "on_log_step", global_step, metrics)
            info = StepInfo(step, global_step, sums, skipped)
            stop = any(call_hooks(hooks, "on_step_end", info))
        if stop:
            break
    progress.close()

    total = all_reduce_sum(sums.clone()).tolist()
    return {
        "train_loss": total[LOSS] / max(total[COUNT], 1),
        "train_acc": total[CORRECT] / max(total[COUNT], 1),
        "train_samples": int(total[COUNT]),
        "steps": step,
        "micro_batch": plan.micro_batch,
    }


def train_step(
    state: StepState, images: torch.Tensor, targets: torch.Tensor, timer: PhaseTimer = NO_TIMER
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on one loaded batch; returns its [loss_sum, correct, count], and
    (with a GradScaler) a device flag set when the scaler skipped the step.

    With ``plan.retry_on_oom``, an out-of-memory error on any rank makes every rank drop the
    step's partial gradients and metrics, put back the BatchNorm statistics, and redo the step
    from its start with half the micro-batch: no sample is skipped or counted twice.
    """
    model, plan, scaler = state.model, state.plan, state.scaler
    snapshot = BufferSnapshot(model) if plan.retry_on_oom else None
    while True:
        state.optimizer.zero_grad(set_to_none=True)
        with timer.phase("forward_backward"):
            step_sums = accumulate_gradients(state, images, targets)
        if step_sums is not None:
            break
        snapshot.restore()
        release_memory(state.device)
        failed_size = plan.size_for(len(targets))
        plan.shrink(len(targets))  # every rank: they agreed on the failure
        ddp = _ddp(model)
        if ddp is not None:
            reset_ddp_after_failed_attempt(ddp)
        log.warning(
            f"out of memory with micro-batch {failed_size}; redoing this step "
            f"with micro-batch {plan.micro_batch}"
        )
    # The GradScaler unscales the accumulated gradient once, and skips the step if any
    # micro-batch overflowed in float16 (then ``update`` lowers the scale: compared on the
    # device, without waiting for it; ``_get_scale_async`` is private, in every torch 2.x).
    with timer.phase("optimizer"):
        scale_before = scaler._get_scale_async().clone() if scaler.is_enabled() else None
        if state.clip_grad_norm:
            clip_gradients(state)
        scaler.step(state.optimizer)
        scaler.update()
        skipped = None if scale_before is None else scaler._get_scale_async() < scale_before
    return step_sums, skipped


def clip_gradients(state: StepState) -> None:
    """Clip the step's whole gradient (every micro-batch's, accumulated) to
    ``state.clip_grad_norm``. Under a GradScaler the gradients are unscaled first, or the limit
    would apply to the loss-scaled ones; ``scaler.step`` then knows they are unscaled, and still
    skips the step if they overflowed. Only groups that learn this step count: a frozen
    backbone's gradients (learning rate 0) do not shrink the head's."""
    state.scaler.unscale_(state.optimizer)
    params = [
        p
        for group in state.optimizer.param_groups
        if group["lr"] > 0
        for p in group["params"]
        if p.grad is not None
    ]
    torch.nn.utils.clip_grad_norm_(params, state.clip_grad_norm)


def accumulate_gradients(
    state: StepState, images: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor | None:
    """Forward and backward over the micro-batches of one batch; returns the step's metric sums,
    or None on every rank when any rank ran out of memory (only with ``plan.retry_on_oom``).

    Ranks agree twice, on the host, at points every rank reaches exactly once per attempt:
    after copying the inputs, before the first forward (under DDP a forward may run a
    collective: the bucket rebuild after a redone step, so a rank that failed in its copy must
    not skip it while the others are in it); and after the forwards, before the last
    micro-batch's backward where DDP exchanges gradients (a rank that ran out of memory in an
    earlier micro-batch stops and waits there).
    """
    model, scaler, plan, device = state.model, state.scaler, state.plan, state.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    size = plan.size_for(len(targets))
    chunks = _inputs_on_device(images, targets, size, device, plan)
    if plan.retry_on_oom and any_rank(chunks is None):
        return None
    last_loss, failed = None, False
    for index, (x, y) in enumerate(chunks):
        is_last = index == len(chunks) - 1
        try:
            with contextlib.nullcontext() if is_last else _no_sync(model):
                logits, loss = forward_loss(model, x, y, state.criterion, state.precision)
            record_metrics(sums, logits, loss, y)
            # Weighted by its share of the batch: the micro-batch gradients add up to the
            # gradient of the mean loss over the whole batch.
            weighted = loss * (len(y) / len(targets))
            if is_last:
                last_loss = weighted
            else:
                scaler.scale(weighted).backward()
        except RuntimeError as err:
            if not (plan.retry_on_oom and is_out_of_memory(err)):
                raise
            failed = True
            break
    del chunks  # each micro-batch's input can go once its backward ran
    if plan.retry_on_oom and any_rank(failed):
        return None
    return sums if _synced_backward(model, scaler, last_loss, plan) else None


def _inputs_on_device(
    images: torch.Tensor, targets: torch.Tensor, size: int, device: torch.device, plan: MemoryPlan
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Every micro-batch of the batch on the device (the fitting counts the whole batch's
    inputs there), or None if that ran out of memory and the plan retries."""
    try:
        return [
            to_device(x, y, device, plan.channels_last)
            for x, y in zip(images.split(size), targets.split(size), strict=True)
        ]
    except RuntimeError as err:
        if not (plan.retry_on_oom and is_out_of_memory(err)):
            raise
        return None


def _synced_backward(
    model: nn.Module, scaler: torch.amp.GradScaler, loss: torch.Tensor, plan: MemoryPlan
) -> bool:
    """The last micro-batch's backward, where DDP exchanges gradients. False if it ran out of
    memory and can be redone: only without DDP. Under DDP the other ranks are already inside
    the gradient exchange, which cannot be called off, so the error ends the run."""
    try:
        scaler.scale(loss).backward()
        return True
    except RuntimeError as err:
        if not (plan.retry_on_oom and is_out_of_memory(err)):
            raise
        if _ddp(model) is not None:
            log.error(
                "out of memory during the gradient exchange of the last micro-batch, "
                "which cannot be redone on one rank alone; restart with --resume auto "
                "(and a smaller --max_memory_gb)"
            )
            raise
    return False


def _ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of ``model``, also when torch.compile wrapped it, or None."""
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, DistributedDataParallel) else None


def _no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` (accumulate locally, exchange nothing), or nothing for a plain model."""
    ddp = _ddp(model)
    return ddp.no_sync() if ddp is not None else contextlib.nullcontext()


# DDP's private state that a redone step resets (see ``reset_ddp_after_failed_attempt``):
# (owner, attribute). requirements.txt allows torch 2.3 to 2.14; these exist in all of them.
DDP_INTERNALS = (
    ("reducer", "_reset_state"),
    ("ddp", "_has_rebuilt_buckets"),
    ("ddp", "require_forward_param_sync"),
)


def check_ddp_internals(ddp: DistributedDataParallel | None) -> None:
    """Stop before training if this torch's DDP lacks what the out-of-memory retry resets."""
    if ddp is None:
        return
    owners = {"ddp": ddp, "reducer": getattr(ddp, "reducer", None)}
    missing = [
        f"{owner}.{name}" for owner, name in DDP_INTERNALS if not hasattr(owners[owner], name)
    ]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__}'s DistributedDataParallel has no {', '.join(missing)}, "
            "which the out-of-memory retry of --low_memory / --auto_micro_batch resets under "
            "DDP; use a torch release from 2.3 to 2.14, or turn the retry off "
            "(--max_memory_gb without --low_memory)"
        )


def reset_ddp_after_failed_attempt(ddp: DistributedDataParallel) -> None:
    """Put DDP back into the same state on every rank before a step is redone.

    Ranks that reached the last micro-batch ran a synchronised forward whose backward never ran:
    their DDP reducer still expects that backward and would treat the next one (a ``no_sync``
    one) as the gradient exchange, on those ranks only, so ranks would call different
    collectives and hang. ``reducer._reset_state()`` is DDP's own recovery for "a backward that
    did not succeed" (``DistributedDataParallel._update_process_group`` uses it). Likewise DDP
    broadcasts buffers at the first forward after a synchronised one, which some ranks had and
    some had not: every rank broadcasts them at the next forward. These are private: the
    attributes are checked by ``check_ddp_internals`` (at the epoch's start and here).
    """
    check_ddp_internals(ddp)
    ddp.reducer._reset_state()
    ddp._has_rebuilt_buckets = False
    ddp.require_forward_param_sync = True


def to_device(
    images: torch.Tensor, targets: torch.Tensor, device: torch.device, channels_last: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move one micro-batch to the device, in the model's memory layout."""
    layout = torch.channels_last if channels_last else torch.preserve_format
    return (
        images.to(device, non_blocking=True, memory_format=layout),
        targets.to(device, non_blocking=True),
    )


def forward_loss(
    model: nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor,
    criterion: nn.Module,
    precision: Precision,
) -> tuple[torch.Tensor, torch.Tensor]:
    with precision.autocast(images.device):
        logits = model(images)
        loss = criterion(logits, targets)
    return logits, loss


@torch.no_grad()
def record_metrics(
    sums: torch.Tensor, logits: torch.Tensor, loss: torch.Tensor, targets: torch.Tensor
) -> None:
    sums[LOSS] += loss.detach().double() * targets.size(0)
    # Soft targets (mixup/cutmix): a prediction is correct when it is the target's dominant
    # label, the one with the larger share of the mixed image.
    labels = targets.argmax(dim=1) if targets.ndim == 2 else targets
    sums[CORRECT] += (logits.argmax(dim=1) == labels).sum()
    sums[COUNT] += targets.size(0)


# Called by ``evaluate`` with each micro-batch's float32 logits, top-1 predictions and targets,
# on the device, in the order the loader yields them: per-sample work such as a confusion matrix.
PredictionHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def evaluate(
    model: nn.Module,
    loader,
    device: torch.device,
    precision: Precision,
    show_progress: bool = True,
    plan: MemoryPlan | None = None,
    on_predictions: PredictionHook | None = None,
) -> dict[str, float]:
    """Loss, top-1 and top-5 over this rank's shard, summed over all ranks; loaded batches go
    through the model in ``plan``'s micro-batches, as in training. ``on_predictions`` sees every
    prediction (src/evaluate.py's report is built from this same pass, so it matches the
    ``val_acc`` recorded in training).

    Every rank must call this (the final all-reduce is a collective). Shards are uneven by at
    most one image, which is fine: ``model`` is the unwrapped module, so the forward passes run
    no collectives and no rank waits for another inside the loop.
    """
    total = evaluation_sums(
        model, loader, device, precision, show_progress, plan, on_predictions
    ).tolist()
    count = max(total[COUNT], 1)
    return {
        "val_loss": total[LOSS] / count,
        "val_acc": total[CORRECT] / count,
        "val_top5": total[TOP5] / count,
        "val_samples": int(total[COUNT]),
    }


@torch.no_grad()
def evaluation_sums(
    model: nn.Module,
    loader,
    device: torch.device,
    precision: Precision,
    show_progress: bool = True,
    plan: MemoryPlan | None = None,
    on_predictions: PredictionHook | None = None,
) -> torch.Tensor:
    """``evaluate``'s pass: [loss_sum, correct, count, top5_correct] summed over all ranks, as
    float64 on the device. Every rank must call this."""
    model.eval()
    plan = plan or MemoryPlan()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for batch_images, batch_targets in tqdm(
        loader, desc="val", disable=not show_progress, dynamic_ncols=True, leave=False
    ):
        size = plan.size_for(len(batch_targets))
        for x, y in zip(batch_images.split(size), batch_targets.split(size), strict=True):
            images, targets = to_device(x, y, device, plan.channels_last)
            with precision.autocast(device):
                logits = model(images)
            k = min(5, logits.size(1))
            top = logits.topk(k, dim=1).indices
            sums[LOSS] += F.cross_entropy(logits.float(), targets, reduction="sum").double()
            sums[CORRECT] += (top[:, 0] == targets).sum()
            sums[TOP5] += (top == targets[:, None]).any(dim=1).sum()
            sums[COUNT] += targets.size(0)
            if on_predictions is not None:
                on_predictions(logits.float(), top[:, 0], targets)
    return all_reduce_sum(sums)

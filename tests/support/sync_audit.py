"""Host-device synchronisations and dispatched ops of the training step and the device half of
the data path, counted per step over a real epoch (``audited_epoch``).

``SyncAudit`` is a ``TorchDispatchMode`` that records every op that would make the host wait
for a CUDA device: scalar reads (``.item()``, ``bool(t)``, ``torch.equal``), ops whose output
shape depends on the data (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing),
blocking device-to-host copies, and ``.tolist()``/``.numpy()`` of tensors. On a CPU-only machine
nothing really waits: the op kinds stand in for CUDA's behaviour. On CUDA, ``audited_epoch``
also runs under ``torch.cuda.set_sync_debug_mode("warn")``.

The loader's host half (sampler, dataset, collate) is left out of the audit; everything from
the loaded batch on is in: the move to the device, the augmentation there, the step, the
metrics and the hooks (EMA, stop agreement, logging). On the CPU, host and device tensors are
told apart by origin: the loaded batch's tensors and what is computed from them alone are host
tensors (reading them never waits for a GPU), until ``Tensor.to(device)`` moves one, which here
makes a copy as CUDA would. Each op is attributed to a
window: "step k" runs from the end of step k - 1's hooks to the end of step k's, so a logging
step's window holds its log work; "end" is the epoch's end (which may synchronise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from imgtrainer.hooks import Hook, StepInfo

aten = torch.ops.aten

SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}


def _is_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def sync_kind(func, args: tuple, kwargs: dict) -> str | None:
    """Why ``func`` would make the host wait for a CUDA device, or None."""
    if func in SCALAR_READS:
        return "scalar read"
    if func in DATA_DEPENDENT:
        return "data-dependent shape"
    if func in INDEXING and len(args) > 1:
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            return "boolean-mask indexing"
    # copy_(self, src, non_blocking) takes it positionally too; _to_copy only by keyword.
    positional = func is aten.copy_.default and len(args) > 2 and bool(args[2])
    if func in COPIES and not (kwargs.get("non_blocking", False) or positional):
        source = args[1] if func is aten.copy_.default else args[0]
        target_cpu = (
            args[0].device.type == "cpu"
            if func is aten.copy_.default
            else str(kwargs.get("device", "")).startswith("cpu")
        )
        if _is_device(source) and target_cpu:
            return "blocking device-to-host copy"
    return None


class SyncAudit(TorchDispatchMode):
    """Records, per window (``label``), the ops dispatched and the would-be synchronisations."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        # On CUDA a tensor's device says where it lives: an op on CPU tensors alone (made in
        # another thread, where this mode does not see them) cannot wait for the GPU.
        self.cuda = cuda
        self.label = "step 1"
        self.syncs: list[tuple[str, str, str]] = []  # (window, kind, op)
        self.ops: Counter[str] = Counter()
        self.paused = False
        self.host = WeakIdKeyDictionary()  # host tensors (the loaded batch and its derivations)
        self.cuda_warnings: list[tuple[str, str]] = []  # set_sync_debug_mode's, per window
        self.thread = threading.current_thread()  # the training thread: its step is audited

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = bool(inputs) and all(self.is_host(t) for t in inputs)
        kind = None if on_host else sync_kind(func, args, kwargs)
        if kind is not None:
            self.syncs.append((self.label, kind, str(func)))
        self.ops[self.label] += 1
        out = func(*args, **kwargs)
        if on_host:
            self.mark_host(out)
        return out

    def is_host(self, tensor: torch.Tensor) -> bool:
        return tensor in self.host or (self.cuda and tensor.device.type == "cpu")

    def mark_host(self, tree) -> None:
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self.host[t] = True
            elif dataclasses.is_dataclass(t):  # a loaded batch's parts (Ragged, EncodedBatch)
                self.mark_host([getattr(t, f.name) for f in dataclasses.fields(t)])

    def host_read(self, tensor: torch.Tensor, name: str) -> None:
        """A read of a device tensor on the host, by the training thread: the step's own. The
        decode and audit threads read theirs without holding up a step."""
        if threading.current_thread() is not self.thread:
            return
        if not self.paused and not self.is_host(tensor):
            self.syncs.append((self.label, "host read", name))

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Leave what runs inside out of the audit (the loader's host half)."""
        self.paused = True
        try:
            with _disable_current_modes():
                yield
        finally:
            self.paused = False

    @contextlib.contextmanager
    def reading_host(self) -> Iterator[SyncAudit]:
        """Also record ``Tensor.tolist``/``Tensor.numpy`` (no dispatched op on the CPU), and
        make ``Tensor.to(device)`` of a host tensor a copy, on the device side."""
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "to")}

        def recorded(name):
            def read(tensor, *args, **kwargs):
                self.host_read(tensor, f"Tensor.{name}")
                return originals[name](tensor, *args, **kwargs)

            return read

        def moved(tensor, *args, **kwargs):
            out = originals["to"](tensor, *args, **kwargs)
            named = "device" in kwargs or any(isinstance(a, torch.device | str) for a in args)
            if self.paused or not named or tensor not in self.host:
                return out
            if out is tensor:
                out = tensor.clone()
            self.host.pop(out, None)
            return out

        for name in ("tolist", "numpy"):
            setattr(torch.Tensor, name, recorded(name))
        torch.Tensor.to = moved
        try:
            with self:
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    def per_window(self) -> Counter[str]:
        return Counter(window for window, _, _ in self.syncs)


class StepWindows(Hook):
    """The last hook of the audited epoch: each step's end starts the next step's window."""

    def __init__(self, audit: SyncAudit):
        self.audit = audit

    def on_step_end(self, info: StepInfo) -> bool:
        self.audit.label = f"step {info.step + 1}"
        return False


class LogReader(Hook):
    """Wants the logging step, so the loop reads its metrics as a run's trackers make it."""

    def __init__(self):
        self.logged: list[tuple[int, dict[str, float]]] = []

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        self.logged.append((global_step, metrics))


class HostHalf:
    """The loader's host half (a DataLoader) with each fetch left out of the audit."""

    def __init__(self, loader, audit: SyncAudit):
        self.loader, self.audit = loader, audit

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)

    def __iter__(self):
        with self.audit.pause():
            iterator = iter(self.loader)
        while True:
            with self.audit.pause():
                batch = next(iterator, None)
            if batch is None:
                return
            self.audit.mark_host(batch)
            yield batch


@dataclass
class AuditResult:
    audit: SyncAudit
    log_interval: int
    steps: int
    logged: list = field(default_factory=list)
    epoch: dict = field(default_factory=dict)
    audited: set[int] = field(default_factory=set)  # the steps whose batch the data audit saw

    def is_log_step(self, window: str) -> bool:
        return window.startswith("step ") and int(window[5:]) % self.log_interval == 0

    def unexpected_syncs(self) -> list[tuple[str, str, str]]:
        """Syncs outside the logging steps and the epoch's end."""
        return [
            s
            for s in self.audit.syncs
            if s[0] != "end" and not self.is_log_step(s[0]) and int(s[0][5:]) <= self.steps
        ]

    def unexpected_cuda_warnings(self) -> list[tuple[str, str]]:
        """``set_sync_debug_mode``'s warnings outside the logging steps and the epoch's end."""
        return [
            w for w in self.audit.cuda_warnings
            if w[0].startswith("step ") and not self.is_log_step(w[0]) and int(w[0][5:]) <= self.steps
        ]  # fmt: skip

    def summary(self) -> dict:
        """The figures as JSON: syncs per window, the unexpected ones, the ops per plain step."""
        return {
            "steps": self.steps,
            "log_interval": self.log_interval,
            "syncs_per_window": dict(self.audit.per_window()),
            "unexpected_syncs": self.unexpected_syncs(),
            "cuda_sync_warnings": self.audit.cuda_warnings,
            "unexpected_cuda_warnings": self.unexpected_cuda_warnings(),
            "ops_per_plain_step": self.ops_per_plain_step(),
        }

    def ops_per_plain_step(self, audited: bool = False) -> list[int]:
        """Ops dispatched in each step's window that is neither a logging step nor the first
        (lazy set-up) -- the launches per batch -- among the steps whose batch the data audit
        copies an image of (a few ops more), or, by default, the others."""
        return [
            self.audit.ops[f"step {k}"]
            for k in range(2, self.steps + 1)
            if k % self.log_interval != 0 and (k in self.audited) == audited
        ]


def audit_due(batch: int, every: int) -> bool:
    """Whether the data audit copies out an image of the run's ``batch``-th batch."""
    from imgtrainer.data.device.audit import FIRST_BATCHES

    return batch <= FIRST_BATCHES or batch % every == 0


def host_side(audit: SyncAudit, work, *args):
    with audit.pause():
        return work(*args)


def audited_epoch(
    parts, loader, *, log_interval: int, hooks: list[Hook] = (), nonfinite: bool = True
) -> AuditResult:
    """One epoch of the real loop over ``loader`` (a ``DeviceBatches``) under ``SyncAudit``:
    ``hooks`` (EMA, stop) run as the trainer runs them, then a log reader and the windows;
    ``nonfinite``: with the trainer's non-finite loss check."""
    from imgtrainer.training.loop import EpochPlan, train_one_epoch
    from imgtrainer.training.nonfinite import NonFiniteLoss

    audit = SyncAudit(cuda=parts.device.type == "cuda")
    loader.loader = HostHalf(loader.loader, audit)
    if loader.audit is not None and loader.audit._thread is None:
        # The data audit remakes an image from its host copy: on CUDA in a thread of its own,
        # on the CPU at once in this one; it waits for no device either way.
        remake = loader.audit._check
        loader.audit._check = lambda *args: host_side(audit, remake, *args)
    reader = LogReader()
    check = NonFiniteLoss(parts.device, distributed=False) if nonfinite else None
    plan = EpochPlan(log_interval=log_interval, nonfinite=check)
    debug = torch.cuda.set_sync_debug_mode if parts.device.type == "cuda" else lambda mode: None

    def caught(message, category, *args, **kwargs) -> None:
        # set_sync_debug_mode's warnings in the training thread: the other threads (decoding,
        # the data audit) wait on their own, and other warnings are no synchronisation.
        if threading.current_thread() is audit.thread and "synchroniz" in str(message):
            audit.cuda_warnings.append((audit.label, str(message)[:200]))

    try:
        with audit.reading_host(), warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = caught
            debug("warn")
            epoch = train_one_epoch(
                parts, loader, hooks=[*hooks, reader, StepWindows(audit)], epoch=plan
            )
            audit.label = "end"
    finally:
        debug(0)
        loader.loader = loader.loader.loader
    every = loader.audit.every if loader.audit is not None else 0
    audited = {n for n in range(1, epoch["steps"] + 1) if every and audit_due(n, every)}
    return AuditResult(audit, log_interval, epoch["steps"], reader.logged, epoch, audited)


# ----------------------------------------------------------------------------- a run to audit


def audit_run(
    train: Path,
    val: Path,
    source: str,
    batch: int,
    precision: str = "fp32",
    *,
    device: str = "cpu",
    log_interval: int = 4,
    ema: bool = True,
    extra_flags: Sequence[str] = (),
) -> AuditResult:
    """One audited epoch of a tiny run (test_resnet, SGD) on ``device`` with --cache_images
    ``source`` and ``precision`` (fp32, fp16: float16 autocast and GradScaler, bf16), the EMA
    and the stop agreement as the trainer registers them."""
    import torch

    import imgtrainer.data.loaders as loaders
    from imgtrainer.config import parse_config
    from imgtrainer.distributed.setup import DistInfo
    from imgtrainer.precision import Precision, make_grad_scaler
    from imgtrainer.training.build import build_run_parts
    from imgtrainer.training.ema import ModelEma
    from imgtrainer.training.periodic import CheckpointAndStop, SaveSchedule
    from imgtrainer.training.stopping import StopRequest

    dist = DistInfo(0, 0, 1, 1, torch.device(device))
    flags = ["--train_dir", str(train), "--val_dir", str(val), "--image_size", "16"]
    flags += ["--num_workers", "0", "--learning_rate", "0.01", "--model", "test_resnet"]
    flags += ["--batch_size", str(batch), "--cache_images", source, "--optimizer", "sgd"]
    flags += ["--log_dir", str(train.parent / "logs"), *extra_flags]
    cfg = parse_config(flags)
    built = loaders.open_data(cfg, dist).loaders()
    train_loader, sampler, class_names = built.train, built.sampler, built.class_names
    parts = build_run_parts(cfg, dist, len(class_names), len(train_loader))
    if precision != "fp32":
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        parts.precision = Precision(True, dtype)
        parts.scaler = make_grad_scaler(parts.precision, dist.device)
    hooks: list[Hook] = [ModelEma(parts.plain_model)] if ema else []
    stop = StopRequest(distributed=False)
    saves = SaveSchedule(steps=0, seconds=0.0)
    hooks.append(CheckpointAndStop(stop, lambda *_: False, lambda sums: None, 10**6, saves))
    sampler.set_epoch(0)
    # float16 autocast on the CPU makes this tiny model's loss NaN after a few steps (the
    # GradScaler then skips them all, which the EMA path needs anyway): no loss check there.
    check = not (precision == "fp16" and device == "cpu")
    return audited_epoch(
        parts, train_loader, log_interval=log_interval, hooks=hooks, nonfinite=check
    )

"""Every private torch internal and torch version check the project uses, in one place.

Each internal is reached through one function or constant here; ``require`` stops with one line
naming what this torch lacks. tests/test_torch_compat.py checks them against the installed torch.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

T = TypeVar("T")

# (major, minor) of the installed torch, for version checks.
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# The attribute of torch.compile's wrapper (OptimizedModule) holding the compiled module.
COMPILED_MODULE_ATTR = "_orig_mod"

# DDP's private state that a redone step resets (see ``reset_ddp_after_failed_attempt``):
# (owner, attribute). requirements.txt allows torch 2.5 to 2.14; these exist in all of them.
DDP_INTERNALS = (
    ("reducer", "_reset_state"),
    ("ddp", "_has_rebuilt_buckets"),
    ("ddp", "require_forward_param_sync"),
)


# torch's multi-tensor ("foreach") kernels: one call for a list of tensors, a few launches in all.
# Private by name only: torch's optimizers, its AMP and timm's EMA are built on them; every
# torch that requirements.txt allows has these.
foreach_copy_ = torch._foreach_copy_
foreach_lerp_ = torch._foreach_lerp_
foreach_sub = torch._foreach_sub
foreach_mul_ = torch._foreach_mul_
foreach_add_ = torch._foreach_add_


# How memory exhaustion reads when it is not torch's own OutOfMemoryError, lower-cased: the CPU
# allocator; MPS; cuDNN, which reports a convolution whose workspace cannot be allocated as having
# no usable algorithm or engine; cuBLAS failing to allocate its handle or workspace.
OUT_OF_MEMORY_MESSAGES = (
    "out of memory",
    "can't allocate memory",
    "unable to find a valid cudnn algorithm",
    "was unable to find an engine",  # cuDNN v8/v9 frontend: "GET was unable to ..."
    "cudnn_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "cublas_status_alloc_failed",
)


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or memory exhaustion reported as a plain RuntimeError: the CPU's
    "can't allocate memory", MPS's "out of memory", and on CUDA the cuDNN and cuBLAS errors that
    usually mean their workspace did not fit (so fitting and the retry halve instead of crash)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in text for m in OUT_OF_MEMORY_MESSAGES)


def is_device_fault(err: BaseException) -> bool:
    """A fault of the device itself (an illegal address, an ECC error: CUDA errors are sticky
    and fail every later call alike), not of a file, nor memory exhaustion, which a retry with
    less mends."""
    if is_out_of_memory(err):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch 2.8 and later
    # torchvision's CUDA decoder words a sticky error "Failed to synchronize CUDA stream: 700".
    text = str(err)
    return (accelerator_error is not None and isinstance(err, accelerator_error)) or (
        "CUDA error" in text or re.search(r"CUDA stream: \d+", text) is not None
    )


def release_memory(device: torch.device) -> None:
    """Give the blocks of a failed attempt back, so the smaller retry is not fragmented."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def none_if_out_of_memory(
    attempt: Callable[[], T],
    retry: bool = True,
    release: torch.device | None = None,
    cannot_redo: str = "",
) -> T | None:
    """``attempt()``, or None when it ran out of memory (``is_out_of_memory``) and ``retry``:
    the caller then retries smaller. Any other error propagates, and so does memory exhaustion
    without ``retry``, or with ``cannot_redo`` (logged first as an error line: why this attempt
    cannot be redone). With ``release``, that device gets the failed attempt's blocks back
    (``release_memory``) after the except block, once the traceback no longer pins them."""
    try:
        return attempt()
    except Exception as err:  # only memory exhaustion is retried
        if not (retry and is_out_of_memory(err)):
            raise
        if cannot_redo:
            log.error(cannot_redo)
            raise
    if release is not None:
        release_memory(release)
    return None


@contextlib.contextmanager
def tf32_matmuls() -> Iterator[None]:
    """float32 cuBLAS matmuls in TF32 inside the block. The switch is global: the block must not
    overlap another thread's float32 matmuls. torch 2.9 and later set it as
    ``matmul.fp32_precision`` and refuse a mix with the older ``allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "tf32") if torch_at_least(2, 9) else ("allow_tf32", True)
    before = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


@contextlib.contextmanager
def cudnn_autotuning_off() -> Iterator[None]:
    """cuDNN's other settings as they are, without ``benchmark``'s autotuning inside the block
    (global, like ``tf32_matmuls``): a convolution whose batch size changes every call would
    otherwise be tuned again, with host syncs, for each new size."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def cuda_allocator_backend() -> str:
    """The CUDA caching allocator in use: "native", or "cudaMallocAsync" (set by
    ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``), which reuses memory across streams by
    ordering them itself."""
    return torch.cuda.get_allocator_backend()


class MissingTorchInternal(RuntimeError):
    """This torch lacks a private internal the project relies on."""


def require(owner: str, checks: Iterable[tuple[Any, str, str]], needed_for: str) -> None:
    """Raise one line naming each ``(obj, attribute, label)`` whose ``obj`` lacks ``attribute``:
    "torch 2.x's OWNER has no LABEL, ..., which NEEDED_FOR"."""
    missing = [label for obj, name, label in checks if not hasattr(obj, name)]
    if missing:
        raise MissingTorchInternal(
            f"torch {torch.__version__}'s {owner} has no {', '.join(missing)}, which {needed_for}"
        )


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is release ``major.minor`` or newer."""
    return TORCH_VERSION >= (major, minor)


def fused_optimizer_kernels_exist(device: torch.device) -> bool:
    """AdamW's and SGD's fused kernels: on CUDA and the CPU."""
    return device.type in ("cuda", "cpu")


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's switch for "no buffer broadcast at every forward": torch 2.14 renamed
    ``broadcast_buffers`` to ``forward_sync_buffers`` and warns at every use of the old name;
    older releases (down to the 2.5 that requirements.txt allows) know only the old one."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def compiled_original(model: nn.Module) -> nn.Module:
    """The module inside a torch.compile wrapper (its private ``_orig_mod``), else ``model``."""
    return getattr(model, COMPILED_MODULE_ATTR, model)


def dynamo_supported() -> bool:
    """Whether torch.compile can run on this Python and torch (``torch._dynamo``'s own check)."""
    import torch._dynamo

    return torch._dynamo.is_dynamo_supported()


def grad_scale_on_device(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The GradScaler's current scale, read on the device without waiting for it (private
    ``_get_scale_async``, in every torch 2.x)."""
    return scaler._get_scale_async()


def set_scheduler_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list) -> None:
    """Set what ``get_last_lr()`` returns (private ``_last_lr``), as ``scheduler.step()`` does."""
    scheduler._last_lr = lrs


# The base class of BatchNorm1d/2d/3d and SyncBatchNorm (private, in every torch 2.x).
BATCH_NORM_BASE = nn.modules.batchnorm._BatchNorm


def is_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm of any dimension (their private base ``_BatchNorm``;
    SyncBatchNorm is one too)."""
    return isinstance(module, BATCH_NORM_BASE)


# What SummaryWriter's file writer is needed for, in a missing internal's line.
SUMMARY_NEED = "TensorBoard's curves are written through; run with --no_tensorboard"


def summary_file_writer(writer: Any) -> Any:
    """The event file writer of a TensorBoard ``SummaryWriter`` (private ``_get_file_writer``,
    in every torch 2.x): summaries built by hand go through it as one event."""
    require("SummaryWriter", [(writer, "_get_file_writer", "_get_file_writer")], SUMMARY_NEED)
    return writer._get_file_writer()


def ddp_logging_data(ddp: DistributedDataParallel) -> dict[str, Any]:
    """DDP's own sampled timings (private ``_get_ddp_logging_data``), for the benchmarks."""
    return ddp._get_ddp_logging_data()


def check_ddp_internals(ddp: DistributedDataParallel | None) -> None:
    """Stop before training if this torch's DDP lacks what the out-of-memory retry resets."""
    if ddp is None:
        return
    owners = {"ddp": ddp, "reducer": getattr(ddp, "reducer", None)}
    require(
        "DistributedDataParallel",
        ((owners[owner], name, f"{owner}.{name}") for owner, name in DDP_INTERNALS),
        "the out-of-memory retry of --low_memory / --auto_micro_batch resets under "
        "DDP; use a torch release from 2.5 to 2.14, or turn the retry off "
        "(--max_memory_gb without --low_memory)",
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

"""What the ranks do together: reductions, gathers, broadcasts, barriers, agreements.

The host-side (gloo) group serves small agreements; the checks built on them are peak memory
and replicas in sync.

Every rank must make each call, at the same point; with one process each is a no-op. The process
group and the device are set up in ``setup.py``, the logging per rank in ``logs.py``.
"""

from __future__ import annotations

import datetime
import hashlib
import resource

import torch
import torch.distributed as torch_dist

from imgtrainer import heartbeat
from imgtrainer.errors import UserError


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: object | None = None) -> torch.Tensor:
    """Reduce a tensor over all ranks in place with ``op`` ("sum", "max" or "min"); a no-op for
    one process. Every rank must call it."""
    if torch_dist.is_initialized():
        with heartbeat.phase(heartbeat.Phase.COLLECTIVE):
            torch_dist.all_reduce(tensor, op=getattr(torch_dist.ReduceOp, op.upper()), group=group)
    return tensor


# The names the training step, loop and trainer read best at their call sites.
def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    return all_reduce(tensor, "sum")


def all_reduce_max(tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
    return all_reduce(tensor, "max", group)


def all_reduce_min(tensor: torch.Tensor) -> torch.Tensor:
    return all_reduce(tensor, "min")


# The gloo twin of the default NCCL group, as (default group, twin); creating a group is a
# collective, so it is made once (by setup_distributed) and reused by every host-side agreement.
_host_group: list[tuple[object, object]] = []


def host_group(timeout: datetime.timedelta | None = None) -> object | None:
    """A gloo group for small control messages on the host: under NCCL, agreeing on a flag
    through it costs no GPU synchronisation. None (the default group) without CUDA.

    Made at the first call for the current default group, with ``timeout`` (setup_distributed
    passes --dist_timeout_minutes; without it gloo's default of 30 minutes), and reused after.
    Every rank must make that first call, at the same point."""
    if not torch_dist.is_initialized() or torch_dist.get_backend() == "gloo":
        return None
    world = torch_dist.group.WORLD
    if not _host_group or _host_group[0][0] is not world:  # a new job in this process
        _host_group[:] = [(world, torch_dist.new_group(backend="gloo", timeout=timeout))]
    return _host_group[0][1]


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank. Every rank must call it.

    The flag is a host bool, so it travels as a CPU tensor over the host group: under NCCL a
    CUDA tensor and ``.item()`` would make the host wait for all the GPU work queued so far."""
    if not torch_dist.is_initialized():
        return flag
    return bool(all_reduce_max(torch.tensor([int(flag)]), group=host_group()).item())


def all_gather_rows(row: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Every rank's 1-D ``row`` (of one length), stacked in rank order. Every rank must call it."""
    if not torch_dist.is_initialized():
        return row[None]
    rows = [torch.empty_like(row) for _ in range(torch_dist.get_world_size(group))]
    with heartbeat.phase(heartbeat.Phase.COLLECTIVE):
        torch_dist.all_gather(rows, row, group=group)
    return torch.stack(rows)


def world_size() -> int:
    """Processes in the job: 1 without a process group."""
    return torch_dist.get_world_size() if torch_dist.is_initialized() else 1


def all_gather_objects(obj: object) -> list:
    """Every rank's ``obj``, in rank order. Every rank must call it."""
    if not torch_dist.is_initialized():
        return [obj]
    gathered: list = [None] * torch_dist.get_world_size()
    with heartbeat.phase(heartbeat.Phase.COLLECTIVE):
        torch_dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank. Every rank must call it.

    DDP broadcasts buffers at the start of each forward, but the forward itself then updates them
    from the local batch, so after the last step of an epoch the ranks differ. Syncing here means
    every rank evaluates, and rank 0 saves, the same model.
    """
    if torch_dist.is_initialized():
        for buffer in model.buffers():
            torch_dist.broadcast(buffer, src=0)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far, the largest over all ranks."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return all_reduce_max(torch.tensor([peak], device=device)).item()


def check_ranks_in_sync(model: torch.nn.Module) -> None:
    """Every rank must call this. Stops with one line naming the first tensor that differs."""
    digests = {
        name: hashlib.sha1(
            t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
    }
    per_rank = all_gather_objects(digests)
    for name in digests:
        values = [d[name] for d in per_rank]
        if len(set(values)) > 1:
            ranks = [r for r, v in enumerate(values) if v != values[0]]
            raise UserError(
                f"--check_sync: {name} differs between rank 0 and rank(s) {ranks}; "
                "the replicas have drifted apart"
            )


def barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()

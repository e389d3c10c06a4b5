"""All rank logic lives here: process-group setup, device choice, logging per rank, reductions.

Training and evaluation code never test ``rank == 0``: they log through the logger set up here
(console on the main process only, a file per rank) and hand main-process-only work to objects
built with ``enabled=dist.is_main``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import resource
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from errors import UserError
from lifecycle import die_with_parent

# The project logger: every module logs to a child of it (``trainer.<module>``), and
# ``logging_for_run`` gives it its handlers, so library loggers (torch, timm) are left alone.
PROJECT_LOGGER = "trainer"
log = logging.getLogger(f"{PROJECT_LOGGER}.{__name__}")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def choose_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "--device cuda was asked for but no CUDA GPU is visible; "
            "use --device cpu or check CUDA_VISIBLE_DEVICES and the driver"
        )
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(
            f"local rank {local_rank} needs GPU {local_rank} but only "
            f"{torch.cuda.device_count()} are visible; start fewer processes per node"
        )
    return torch.device("cuda", local_rank)


def cpu_cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def available_memory_bytes() -> int:
    """Memory that can be used without swapping (MemAvailable), for sizing in-memory caches."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def setup_distributed(requested_device: str = "auto", timeout_minutes: float = 30.0) -> DistInfo:
    """Read torchrun's environment (or assume one process) and join the process group."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts each rank in its own session: without this, a rank whose agent was
        # killed would train on, an orphan. SIGTERM stops it like any SIGTERM (a checkpoint).
        die_with_parent(signal.SIGTERM)
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = choose_device(requested_device, local_rank)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # torchrun sets OMP_NUM_THREADS=1 for every worker; give each process its share of the
        # cores instead, so 1 process uses them all and N processes do not oversubscribe.
        torch.set_num_threads(max(1, cpu_cores_available() // local_world_size))

    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=timeout_minutes)
        torch_dist.init_process_group(
            backend,
            store=_rendezvous_store(world_size),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        host_group(timeout)  # now, with the job's timeout; later calls reuse it
    return DistInfo(rank, local_rank, world_size, local_world_size, device)


def _rendezvous_store(world_size: int) -> torch_dist.Store:
    """The TCP store for this attempt, namespaced by torchrun's restart count.

    After a torchrun restart, workers that init through env:// read the peer addresses that the
    dead attempt left in the store and fail in gloo's connectFullMesh ("Connection refused").
    Prefixing every key with the attempt number gives each restart a clean namespace.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_server = int(os.environ.get("RANK", 0)) == 0 and not agent_hosts_store
    store = torch_dist.TCPStore(
        host,
        port,
        world_size=None if agent_hosts_store else world_size,
        is_master=is_server,
        timeout=datetime.timedelta(minutes=5),
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch_dist.PrefixStore(f"attempt{attempt}", store)


def cleanup_distributed() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


@contextlib.contextmanager
def logging_for_run(log_dir: Path, dist: DistInfo, name: str = "train") -> Iterator[None]:
    """While a tool runs, every rank appends to logs/{name}_rank_{r}.log and only the main
    process prints. Afterwards the project logger is as it was, its files closed: a process
    (a test) that runs several tools gets no handler left over from an earlier one."""
    log_dir.mkdir(parents=True, exist_ok=True)
    project = logging.getLogger(PROJECT_LOGGER)
    saved = list(project.handlers), project.level, project.propagate
    project.handlers.clear()
    project.setLevel(logging.INFO)
    project.propagate = False
    file_handler = logging.FileHandler(log_dir / f"{name}_rank_{dist.rank}.log")
    file_handler.setFormatter(_LevelFormatter("%(asctime)s [rank %(rank)s] %(message)s"))
    file_handler.addFilter(_RankFilter(dist.rank))
    project.addHandler(file_handler)
    if dist.is_main:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(_LevelFormatter("%(message)s"))
        project.addHandler(console)
    try:
        yield
    finally:
        for handler in project.handlers:
            handler.close()
        project.handlers[:] = saved[0]
        project.setLevel(saved[1])
        project.propagate = saved[2]


class _LevelFormatter(logging.Formatter):
    """Warnings and errors say so first ("WARNING: ..."); information is the message alone."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.WARNING:
            record.message = f"{record.levelname}: {record.message}"
        return super().formatMessage(record)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: object | None = None) -> torch.Tensor:
    """Reduce a tensor over all ranks in place with ``op`` ("sum", "max" or "min"); a no-op for
    one process. Every rank must call it."""
    if torch_dist.is_initialized():
        torch_dist.all_reduce(tensor, op=getattr(torch_dist.ReduceOp, op.upper()), group=group)
    return tensor


# The names the engine and the trainer read best at their call sites.
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


def world_size() -> int:
    """Processes in the job: 1 without a process group."""
    return torch_dist.get_world_size() if torch_dist.is_initialized() else 1


def all_gather_objects(obj: object) -> list:
    """Every rank's ``obj``, in rank order. Every rank must call it."""
    if not torch_dist.is_initialized():
        return [obj]
    gathered: list = [None] * torch_dist.get_world_size()
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

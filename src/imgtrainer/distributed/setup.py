"""The process group, the device, and what this machine offers each process."""

from __future__ import annotations

import datetime
import os
import signal
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as torch_dist

from imgtrainer.distributed.collectives import host_group
from imgtrainer.distributed.nccl_preflight import (
    Preflight,
    local_facts,
    run_preflight,
    store_gather,
    torch_probe,
)
from imgtrainer.errors import UserError
from imgtrainer.process import TorchrunEnv, cuda_not_visible, die_with_parent, gpus_may_be_shared


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    restart_count: int = 0  # torchrun's restarts so far (TorchrunEnv)
    preflight: Preflight | None = None  # an NCCL job's pre-flight (nccl_preflight)

    first_attempt = TorchrunEnv.first_attempt  # from restart_count, as there

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def processes_on_device(self) -> int:
        """This node's processes that use this process's device (its memory is theirs)."""
        visible = torch.cuda.device_count() if self.device.type == "cuda" else 0
        return processes_sharing_device(self.device, self.local_world_size, visible)


def choose_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError(
            cuda_not_visible("use --device cpu or check CUDA_VISIBLE_DEVICES and the driver")
        )
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if local_rank >= visible and not gpus_may_be_shared():
        raise UserError(
            f"local rank {local_rank} needs GPU {local_rank} but only "
            f"{visible} are visible; start fewer processes per node"
        )
    return torch.device("cuda", local_rank % visible)


def processes_sharing_device(device: torch.device, local_world_size: int, visible_gpus: int) -> int:
    """How many of this node's processes use ``device``: all of them on the CPU (its RAM); on
    GPU d of V, the local ranks r with r % V == d (``choose_device``): more than one only when
    they share the GPUs (``SHARE_GPUS_ENV``)."""
    if device.type != "cuda":
        return max(1, local_world_size)
    return max(1, len(range(device.index or 0, local_world_size, max(1, visible_gpus))))


def memory_share(device_bytes: int, processes: int, max_memory_gb: float | None) -> int:
    """What one of the ``processes`` using a device may plan on of its ``device_bytes`` (total
    or free): an equal share, and no more than ``--max_memory_gb`` (a per-process cap)."""
    share = device_bytes // max(1, processes)
    return share if max_memory_gb is None else min(share, int(max_memory_gb * 2**30))


def process_group_backend(device: torch.device, local_world_size: int) -> str:
    """NCCL with one GPU per process; gloo on the CPU, and when this node's processes share its
    GPUs (``SHARE_GPUS_ENV``), which NCCL refuses (gloo reduces CUDA tensors through the host)."""
    if device.type != "cuda" or local_world_size > torch.cuda.device_count():
        return "gloo"
    return "nccl"


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


def setup_distributed(
    requested_device: str = "auto", timeout_minutes: float = 30.0, env: TorchrunEnv | None = None
) -> DistInfo:
    """Join the process group torchrun's environment describes (``env``, read here if not given;
    one process without torchrun)."""
    env = env or TorchrunEnv.read()
    if env.under_torchrun:
        # torchrun starts each rank in its own session: without this, a rank whose agent was
        # killed would train on, an orphan. SIGTERM stops it like any SIGTERM (a checkpoint).
        die_with_parent(signal.SIGTERM)
    device = choose_device(requested_device, env.local_rank)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # torchrun sets OMP_NUM_THREADS=1 for every worker; give each process its share of the
        # cores instead, so 1 process uses them all and N processes do not oversubscribe.
        torch.set_num_threads(max(1, cpu_cores_available() // env.local_world_size))

    preflight = None
    if env.world_size > 1:
        backend = process_group_backend(device, env.local_world_size)
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store = _rendezvous_store(env)
        join = partial(
            torch_dist.init_process_group,
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
        if backend == "nccl":
            preflight = nccl_preflight(env, store, device, join)
        else:
            join()
        host_group(timeout)  # now, with the job's timeout; later calls reuse it
    return DistInfo(
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        device,
        env.restart_count,
        preflight,
    )


def nccl_preflight(
    env: TorchrunEnv, store: torch_dist.Store, device: torch.device, join
) -> Preflight:
    """``nccl_preflight.run_preflight`` with torch's queries, around ``join``."""
    all_reduce, arrived = torch_probe(store, device, env.rank, env.world_size)
    return run_preflight(
        local_facts(env.rank, env.local_world_size),
        store_gather(store, env.world_size),
        join,
        all_reduce,
        arrived,
        os.environ,
    )


def _rendezvous_store(env: TorchrunEnv) -> torch_dist.Store:
    """The TCP store for this attempt, namespaced by torchrun's restart count.

    After a torchrun restart, workers that init through env:// read the peer addresses that the
    dead attempt left in the store and fail in gloo's connectFullMesh ("Connection refused").
    Prefixing every key with the attempt number gives each restart a clean namespace.
    """
    store = torch_dist.TCPStore(
        env.master_addr,
        env.master_port,
        world_size=None if env.agent_store else env.world_size,
        is_master=env.rank == 0 and not env.agent_store,
        timeout=datetime.timedelta(minutes=5),
        wait_for_workers=False,
    )
    return torch_dist.PrefixStore(f"attempt{env.restart_count}", store)


def cleanup_distributed() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()

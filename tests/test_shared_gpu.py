"""More processes than GPUs: allowed only for the CUDA checks (IMGTRAINER_SHARE_GPUS=1), then the
ranks share the GPUs over gloo; without it one clear error. The CUDA side runs in
tests/gpu/test_shared_gpu_on_cuda.py; here, the choices, with the GPU count faked."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

import imgtrainer.distributed.setup as dist_setup
import imgtrainer.run.launcher as launch_ddp
from imgtrainer.errors import UserError
from imgtrainer.process import SHARE_GPUS_ENV


@pytest.fixture
def one_gpu(monkeypatch):
    """This process sees one CUDA GPU, to torch and to the launcher's count."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launch_ddp, "visible_gpu_count", lambda: 1)
    monkeypatch.delenv(SHARE_GPUS_ENV, raising=False)


def launcher_args(*argv: str) -> argparse.Namespace:
    return launch_ddp.build_parser().parse_known_args(list(argv))[0]


def test_two_ranks_on_one_gpu_only_when_sharing_is_allowed(one_gpu, monkeypatch):
    with pytest.raises(UserError, match="--num_gpus 2 asked for 2 GPUs but only 1 are visible"):
        launch_ddp.resolve_device_and_nproc(launcher_args("--num_gpus", "2"))
    with pytest.raises(UserError, match="local rank 1 needs GPU 1 but only 1 are visible"):
        dist_setup.choose_device("auto", local_rank=1)
    assert dist_setup.process_group_backend(torch.device("cuda", 0), 1) == "nccl"

    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    assert launch_ddp.resolve_device_and_nproc(launcher_args("--num_gpus", "2")) == ("cuda", 2)
    assert dist_setup.choose_device("auto", local_rank=1) == torch.device("cuda", 0)
    assert dist_setup.choose_device("cpu", local_rank=1) == torch.device("cpu")
    # NCCL refuses two ranks on one device: gloo as soon as the node's ranks outnumber its GPUs.
    assert dist_setup.process_group_backend(torch.device("cuda", 0), 2) == "gloo"
    assert dist_setup.process_group_backend(torch.device("cuda", 0), 1) == "nccl"
    assert dist_setup.process_group_backend(torch.device("cpu"), 1) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert dist_setup.choose_device("auto", local_rank=3) == torch.device("cuda", 1)
    assert dist_setup.process_group_backend(torch.device("cuda", 1), 2) == "nccl"


def test_setup_joins_rank_1_of_2_sharing_one_gpu_over_gloo(one_gpu, monkeypatch):
    """setup_distributed as local rank 1 of 2 on a one-GPU node: cuda:0, gloo, no device_id
    (that is NCCL's), and no separate host group (gloo already reduces on the host)."""
    joined, devices = [], []
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    for name, value in (("RANK", 1), ("LOCAL_RANK", 1), ("WORLD_SIZE", 2), ("LOCAL_WORLD_SIZE", 2)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(dist_setup, "_rendezvous_store", lambda world_size: dist.HashStore())
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: joined.append((backend, kw))
    )
    info = dist_setup.setup_distributed("auto", timeout_minutes=3)
    assert info.device == torch.device("cuda", 0) and devices == [torch.device("cuda", 0)]
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (1, 1, 2, 2)
    [(backend, options)] = joined
    assert backend == "gloo" and options["device_id"] is None
    assert (options["rank"], options["world_size"]) == (1, 2)


# ----------------------------------------------------------------------------- memory shares

GIB = 2**30


@pytest.mark.parametrize("processes, visible", [(1, 1), (2, 1), (3, 2), (2, 2), (5, 2), (1, 4)])
def test_processes_on_a_device_are_the_local_ranks_choose_device_puts_there(
    monkeypatch, processes: int, visible: int
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    placed = [dist_setup.choose_device("auto", r) for r in range(processes)]
    for rank, device in enumerate(placed):
        info = dist_setup.DistInfo(rank, rank, processes, processes, device)
        assert info.processes_on_device == placed.count(device)
    assert dist_setup.processes_sharing_device(torch.device("cpu"), processes, visible) == processes


def test_memory_share_splits_the_device_and_caps_at_max_memory_gb():
    share = dist_setup.memory_share
    assert share(80 * GIB, 1, None) == 80 * GIB
    assert share(80 * GIB, 2, None) == 40 * GIB  # two ranks on one GPU: half each
    assert share(80 * GIB, 2, 30) == 30 * GIB  # --max_memory_gb below the share
    assert share(80 * GIB, 2, 60) == 40 * GIB  # above it: two of 60 would not fit in 80
    assert share(80 * GIB, 1, 0.5) == GIB // 2


def test_budget_and_gpu_cache_count_the_processes_sharing_the_gpu(monkeypatch):
    """The CUDA call sites, with the device's figures faked: --auto_micro_batch's budget (of the
    total) and --cache_images auto's GPU budget (a quarter of the free memory), per process;
    an explicit gpu's limit (all of its share)."""
    from imgtrainer.config import TrainConfig
    from imgtrainer.data.image_plan import device_cache_budget
    from imgtrainer.training.memory import memory_budget

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    device = torch.device("cuda", 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: argparse.Namespace(total_memory=80 * GIB)
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (64 * GIB, 80 * GIB))
    alone = dist_setup.DistInfo(0, 0, 1, 1, device)
    pair = dist_setup.DistInfo(1, 1, 2, 2, device)
    assert memory_budget(None, device, alone.processes_on_device) == 80 * GIB
    assert memory_budget(None, device, pair.processes_on_device) == 40 * GIB
    assert memory_budget(50, device, pair.processes_on_device) == 40 * GIB
    cfg = TrainConfig()
    assert device_cache_budget(cfg, alone) == 16 * GIB and device_cache_budget(cfg, pair) == 8 * GIB
    assert device_cache_budget(TrainConfig(max_memory_gb=12), pair) == 3 * GIB
    assert device_cache_budget(TrainConfig(cache_images="ram"), pair) == 0
    # An explicit gpu cache may take this process's whole share: over it, it cannot be allocated.
    assert device_cache_budget(TrainConfig(cache_images="gpu"), pair) == 32 * GIB
    assert device_cache_budget(cfg, dist_setup.DistInfo(0, 0, 1, 1, torch.device("cpu"))) == 0

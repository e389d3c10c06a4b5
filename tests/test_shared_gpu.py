"""More processes than GPUs: allowed only for the self-check (IMGTRAINER_SHARE_GPUS=1), then the
ranks share the GPUs over gloo; without it one clear error. The CUDA side runs in
bench/gpu_check.py's shared_gpu_* checks; here, the choices, with the GPU count faked."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.distributed as dist

import imgtrainer.distributed.setup as dist_setup
import imgtrainer.run.launcher as launch_ddp
from imgtrainer.errors import UserError
from imgtrainer.run.preflight import SHARE_GPUS_ENV
from test_gpu_path import gpu_check_module


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


def test_gpu_check_runs_two_processes_on_one_gpu_with_a_kill_and_resume(tmp_path):
    """The self-check's shared-GPU checks exist, ask the launcher for 2 GPUs with sharing on,
    kill through the tests' fault injection, and read the kill, the resume and the history."""
    gc = gpu_check_module()
    checks = {c.name: c for c in gc.all_checks()}
    for cache in ("gpu", "ram", "none"):
        assert checks[f"shared_gpu_ws2_cache_{cache}"].gpus == 1  # runs on one-GPU machines
    assert checks["shared_gpu_ws2_kill_resume"].gpus == 1
    assert gc.SHARE_GPUS_ENV == {SHARE_GPUS_ENV: "1"}
    env = gc.kill_env(gc.SHARED_KILL_AT)
    assert (gc.FAULT_INJECTION / "sitecustomize.py").is_file()
    assert env["PYTHONPATH"].split(":")[0] == str(gc.FAULT_INJECTION)

    logs = tmp_path / "logs"
    logs.mkdir()
    history = {"world_size": 2, "epochs": [{"epoch": 1}, {"epoch": 2}]}
    assert "not killed" in gc.kill_and_resume_problem(logs, history)
    (logs / "train_rank_1.log").write_text("TRAIN_DDP_KILL_AT: killing rank 1 with SIGKILL at\n")
    assert "no resume at epoch 2, step 4 of 6" in gc.kill_and_resume_problem(logs, history)
    (logs / "train_rank_0.log").write_text("Resumed from c.pth: epoch 2, step 4 of 6 (...)\n")
    assert gc.kill_and_resume_problem(logs, history) == ""
    repeated = json.loads(json.dumps(history))
    repeated["epochs"].insert(1, {"epoch": 2})
    assert "epochs [1, 2, 2]" in gc.kill_and_resume_problem(logs, repeated)

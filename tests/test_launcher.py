"""The command line the launcher builds (--dry_run) and its own errors: in this process, and one
error through the real command line (tests/test_bad_input.py) for its exit code."""

from __future__ import annotations

import shlex

import pytest
import torch

import imgtrainer.run.launcher as launch_ddp
from conftest import ROOT, run_main, user_error_line

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def dry_run(capsys, *flags: str) -> list[str]:
    capsys.readouterr()
    assert run_main(launch_ddp.main, ["--dry_run", *flags]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("Running: ")
    return shlex.split(line[len("Running: ") :])


def test_single_node_cpu_command(capsys):
    cmd = dry_run(capsys, "--device", "cpu", "--nproc", "2", "--epochs", "3", "--use_amp")
    # On the CPU the workers are forks of an agent that imported the trainer once.
    quick_exit = str(ROOT / "src" / "quick_exit.py")
    assert cmd[1:6] == [
        "-u",
        quick_exit,
        "--preload",
        "imgtrainer.run.train",
        "torch.distributed.run:main",
    ]
    assert "--nproc-per-node=2" in cmd and "--nnodes=1" in cmd and "--max-restarts=0" in cmd
    assert "--rdzv-backend=c10d" in cmd
    endpoint = next(a for a in cmd if a.startswith("--rdzv-endpoint="))
    assert endpoint.startswith("--rdzv-endpoint=127.0.0.1:") and int(endpoint.rsplit(":", 1)[1]) > 0
    script = cmd.index(str(ROOT / "src" / "train_ddp.py"))
    assert cmd[script - 2 : script] == ["--start-method=fork", "--run-path"]
    assert cmd[script + 1 :] == ["--device", "cpu", "--epochs", "3", "--use_amp"]  # passed through


def test_start_method_spawn_and_cuda_commands(capsys, monkeypatch):
    """spawn, asked for or with CUDA: torchrun's own way, the script in fresh processes."""
    quick_exit = str(ROOT / "src" / "quick_exit.py")
    script = str(ROOT / "src" / "train_ddp.py")
    spawn = dry_run(capsys, "--device", "cpu", "--start_method", "spawn")
    assert spawn[1:3] == [quick_exit, "torch.distributed.run:main"]
    assert spawn[spawn.index(script) - 1].startswith("--max-restarts=")
    assert not any(a.startswith("--start-method") or a == "--run-path" for a in spawn)

    monkeypatch.setattr(launch_ddp, "visible_gpu_count", lambda: 1)
    cuda = dry_run(capsys, "--device", "cuda")
    assert cuda[1:3] == [quick_exit, "torch.distributed.run:main"] and "--run-path" not in cuda
    forked = dry_run(capsys, "--device", "cuda", "--start_method", "fork")
    assert "--start-method=fork" in forked and forked[forked.index(script) - 1] == "--run-path"


def test_start_method_from_a_run_file_is_checked(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("start_method: spawn\n")
    spawn = dry_run(capsys, "--device", "cpu", "--config", str(run))
    assert "--run-path" not in spawn
    run.write_text("start_method: threads\n")
    line = user_error_line(launch_ddp.main, ["--device", "cpu", "--config", str(run)], capsys)
    assert "start_method must be one of auto, fork, spawn" in line and "'threads'" in line


def test_multi_node_command(capsys):
    cmd = dry_run(
        capsys,
        "--device",
        "cpu",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        "10.1.2.3",
        "--master_port",
        "29400",
        "--max_restarts",
        "3",
    )
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd and "--max-restarts=3" in cmd
    assert "--rdzv-endpoint=10.1.2.3:29400" in cmd and "--rdzv-conf=is_host=0" in cmd
    host = dry_run(
        capsys, "--device", "cpu", "--nnodes", "2", "--node_rank", "0", "--master_addr", "10.1.2.3"
    )
    assert "--rdzv-conf=is_host=1" in host and "--rdzv-endpoint=10.1.2.3:29500" in host


def test_help_lists_launcher_and_trainer_flags(capsys):
    assert run_main(launch_ddp.main, ["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--num_gpus",
        "--nproc",
        "--master_port",
        "--dry_run",  # launcher
        "--batch_size",
        "--use_amp",
        "--lr_scaling",
        "--resume",
    ):  # trainer
        assert flag in out, flag


@no_cuda
def test_more_gpus_than_visible_is_one_clear_error(capsys):
    line = user_error_line(launch_ddp.main, ["--num_gpus", "4"], capsys)
    assert "--num_gpus 4" in line and "0 are visible" in line and "--device cpu" in line


@no_cuda
def test_device_cuda_without_cuda_is_one_clear_error(capsys):
    line = user_error_line(launch_ddp.main, ["--device", "cuda"], capsys)
    assert "--device cuda" in line and "no CUDA GPU" in line


def test_more_gpus_than_visible_names_both_numbers(monkeypatch):
    import argparse

    from imgtrainer.errors import UserError

    # The launcher counts GPUs without torch (preflight.visible_gpu_count).
    monkeypatch.setattr(launch_ddp, "visible_gpu_count", lambda: 2)
    args = argparse.Namespace(device="auto", num_gpus="4", nproc=1)
    with pytest.raises(UserError, match=r"--num_gpus 4 asked for 4 GPUs but only 2 are visible"):
        launch_ddp.resolve_device_and_nproc(args)
    assert launch_ddp.resolve_device_and_nproc(
        argparse.Namespace(device="auto", num_gpus="all", nproc=1)
    ) == ("cuda", 2)

"""The command line the launcher builds (--dry_run) and its own errors."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_user_error, run_cli

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def dry_run(tmp_path: Path, *flags: str) -> list[str]:
    result = run_cli([ROOT / "launch_ddp.py", "--dry_run", *flags], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("Running: ")
    return shlex.split(line[len("Running: "):])


def test_single_node_cpu_command(tmp_path: Path):
    cmd = dry_run(tmp_path, "--device", "cpu", "--nproc", "2", "--epochs", "3", "--use_amp")
    assert cmd[1:4] == [str(ROOT / "src" / "quick_exit.py"), "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--nnodes=1" in cmd and "--max-restarts=0" in cmd
    assert "--rdzv-backend=c10d" in cmd
    endpoint = next(a for a in cmd if a.startswith("--rdzv-endpoint="))
    assert endpoint.startswith("--rdzv-endpoint=127.0.0.1:") and int(endpoint.rsplit(":", 1)[1]) > 0
    script = cmd.index(str(ROOT / "src" / "train_ddp.py"))
    assert cmd[script + 1:] == ["--device", "cpu", "--epochs", "3", "--use_amp"]  # passed through


def test_free_ports_differ_between_runs(tmp_path: Path):
    ports = {next(a for a in dry_run(tmp_path, "--device", "cpu") if "endpoint" in a)
             for _ in range(2)}
    assert len(ports) == 2


def test_multi_node_command(tmp_path: Path):
    cmd = dry_run(tmp_path, "--device", "cpu", "--nnodes", "2", "--node_rank", "1",
                  "--master_addr", "10.1.2.3", "--master_port", "29400", "--max_restarts", "3")
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd and "--max-restarts=3" in cmd
    assert "--rdzv-endpoint=10.1.2.3:29400" in cmd and "--rdzv-conf=is_host=0" in cmd
    host = dry_run(tmp_path, "--device", "cpu", "--nnodes", "2", "--node_rank", "0",
                   "--master_addr", "10.1.2.3")
    assert "--rdzv-conf=is_host=1" in host and "--rdzv-endpoint=10.1.2.3:29500" in host


def test_help_lists_launcher_and_trainer_flags(tmp_path: Path):
    result = run_cli([ROOT / "launch_ddp.py", "--help"], cwd=tmp_path)
    assert result.returncode == 0
    for flag in ("--num_gpus", "--nproc", "--master_port", "--dry_run",      # launcher
                 "--batch_size", "--use_amp", "--lr_scaling", "--resume"):  # trainer
        assert flag in result.stdout, flag


@no_cuda
def test_more_gpus_than_visible_is_one_clear_error(tmp_path: Path):
    result = run_cli([ROOT / "launch_ddp.py", "--num_gpus", "4"], cwd=tmp_path)
    assert_user_error(result, "--num_gpus 4", "0 are visible", "--device cpu")


@no_cuda
def test_device_cuda_without_cuda_is_one_clear_error(tmp_path: Path):
    result = run_cli([ROOT / "launch_ddp.py", "--device", "cuda"], cwd=tmp_path)
    assert_user_error(result, "--device cuda", "no CUDA GPU")


def test_more_gpus_than_visible_names_both_numbers(monkeypatch):
    import argparse

    import launch_ddp
    from errors import UserError

    # The launcher counts GPUs without torch (preflight.visible_gpu_count).
    monkeypatch.setattr(launch_ddp, "visible_gpu_count", lambda: 2)
    args = argparse.Namespace(device="auto", num_gpus="4", nproc=1)
    with pytest.raises(UserError, match=r"--num_gpus 4 asked for 4 GPUs but only 2 are visible"):
        launch_ddp.resolve_device_and_nproc(args)
    assert launch_ddp.resolve_device_and_nproc(
        argparse.Namespace(device="auto", num_gpus="all", nproc=1)) == ("cuda", 2)

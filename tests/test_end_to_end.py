"""What a finished run leaves behind: in one process, and through the real launcher, torchrun
and two gloo processes on a tiny generated dataset."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import timm
import torch
import torchvision

from conftest import launch_on_cpu, start_launcher, tiny_run_flags


def check_run_outputs(workdir: Path, world_size: int) -> None:
    """The history, per-rank logs and checkpoints of a finished 2-epoch run in ``workdir``."""
    history = json.loads((workdir / "logs" / "training_history.json").read_text())
    assert history["world_size"] == world_size and history["device"] == "cpu"
    assert history["config"]["epochs"] == 2 and "torch" in history["versions"]
    assert [r["epoch"] for r in history["epochs"]] == [1, 2]
    for record in history["epochs"]:
        for key in (
            "train_loss",
            "train_acc",
            "val_loss",
            "val_acc",
            "val_top5",
            "lr",
            "epoch_seconds",
            "train_images_per_sec",
            "peak_memory_mb",
        ):
            assert isinstance(record[key], float), key
        assert 0.0 <= record["val_acc"] <= record["val_top5"] <= 1.0
    for rank in range(world_size):
        assert f"rank {rank}" in (workdir / "logs" / f"train_rank_{rank}.log").read_text()

    latest = torch.load(workdir / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    best = torch.load(workdir / "checkpoints" / "checkpoint_best.pth", weights_only=True)
    assert latest["epoch"] == 2 and latest["step"] == 0
    assert latest["class_names"] == ["cat", "dog", "fox"] and latest["image_size"] == 16
    assert latest["best_acc"] == max(r["val_acc"] for r in history["epochs"])
    assert best["best_acc"] == latest["best_acc"]
    assert len(latest["rank_states"]) == world_size
    for key in ("optimizer_state_dict", "scheduler_state_dict", "mean", "std", "config"):
        assert key in latest
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in latest["model_state_dict"])


def test_single_process_run_leaves_checkpoints_history_and_logs(trained_run):
    check_run_outputs(trained_run.root, world_size=1)


@pytest.mark.slow
def test_two_process_run_leaves_checkpoints_history_and_logs(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    result = launch_on_cpu(
        train,
        val,
        *("--epochs", "2", "--check_sync"),
        # Kept epochs and the early-stopping count through the launcher, at no cost: the run
        # still ends after its last epoch.
        *("--save_every_epochs", "1", "--keep_checkpoints", "1"),
        *("--early_stopping_patience", "5"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    kept = sorted(path.name for path in (tmp_path / "checkpoints").glob("checkpoint_epoch_*"))
    assert kept == ["checkpoint_epoch_001.pth", "checkpoint_epoch_002.pth"]
    latest = torch.load(tmp_path / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    first, second = (r["val_acc"] for r in latest["history"])
    improved = second > first
    assert (latest["best_metric"], latest["best_epoch"]) == ("val_acc", 2 if improved else 1)
    assert latest["early_stopping"]["wait"] == (0 if improved else 1)
    assert "torch.distributed.run" in result.stdout.splitlines()[0]  # the printed command
    assert "Done: best val_acc" in result.stdout
    assert "python src/utils.py --history" in result.stdout

    check_run_outputs(tmp_path, world_size=2)


def test_checkpoint_loads_into_plain_models(trained_run):
    state = torch.load(trained_run.best, weights_only=True)
    weights = state["model_state_dict"]

    ours = timm.create_model("resnet18", num_classes=3)  # as docs/usage.md loads it
    ours.load_state_dict(weights, strict=True)
    reference = torchvision.models.resnet18(num_classes=3)
    reference.load_state_dict(weights, strict=True)
    ours.eval(), reference.eval()
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(ours(x), reference(x))


@pytest.mark.slow
def test_two_nodes_on_one_machine(tiny_dataset, tmp_path: Path):
    """Two launchers, one CPU process each, meeting through the c10d rendezvous on 127.0.0.1."""
    from imgtrainer.run.launcher import free_port

    train, val = tiny_dataset
    port = str(free_port())
    nodes = []
    for node_rank in (0, 1):
        workdir = tmp_path / f"node{node_rank}"
        workdir.mkdir()
        nodes.append(
            start_launcher(
                [
                    "--device",
                    "cpu",
                    "--nnodes",
                    "2",
                    "--node_rank",
                    str(node_rank),
                    "--master_addr",
                    "127.0.0.1",
                    "--master_port",
                    port,
                    *tiny_run_flags(train, val),
                    "--epochs",
                    "1",
                ],
                workdir,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # Exactly one node holds global rank 0, and only it writes the history.
    written = [tmp_path / f"node{r}" / "logs" / "training_history.json" for r in (0, 1)]
    written = [path for path in written if path.exists()]
    assert len(written) == 1
    assert json.loads(written[0].read_text())["world_size"] == 2

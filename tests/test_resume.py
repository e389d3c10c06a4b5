"""Crash-safe training: exact resume after SIGKILL, SIGTERM, corrupt and malicious checkpoints."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import pytest
import torch

import imgtrainer.run.launcher as launch_ddp
import imgtrainer.run.train as train_ddp
from conftest import (
    RESNET18,
    ROOT,
    TINY_FLAGS,
    kill_at,
    pack_folder,
    run_cli,
    run_train,
    tiny_run_flags,
    user_error_line,
    write_image_folder,
)
from imgtrainer.events import LAUNCHER_EVENTS, read_events
from test_tensorboard import read_events as read_tensorboard
from test_tensorboard import steps_and_values

TIMING_KEYS = {"epoch_seconds", "train_images_per_sec", "peak_memory_mb", "data_wait_share"}


@pytest.fixture
def resume_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """72 training images: 4 steps per epoch at batch 8 on 2 processes (9 on one)."""
    classes = ["cat", "dog", "fox"]
    return (
        write_image_folder(tmp_path / "data" / "train", classes, 24, seed=1),
        write_image_folder(tmp_path / "data" / "val", classes, 5, seed=2),
    )


def train_flags(train: Path, val: Path, *extra: str) -> list[str]:
    """timm's small ResNet (0.4 M parameters, BatchNorm like resnet18's 11 M): what an exact
    resume must restore is the same, at a fraction of the time of each step and save."""
    return [
        "--model",
        "test_resnet",
        "--train_dir",
        str(train),
        "--val_dir",
        str(val),
        "--deterministic",
        "--optimizer",
        "sgd",
        *TINY_FLAGS,
        *extra,
    ]


def launch(
    workdir: Path, flags: list[str], env: dict[str, str] | None = None, nproc: int = 2
) -> subprocess.CompletedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    return run_cli(
        [ROOT / "launch_ddp.py", "--device", "cpu", "--nproc", nproc, *flags], workdir, env=env
    )


def assert_same_tensors(a: object, b: object, where: str = "") -> int:
    """Bitwise equality of every tensor in two nested structures; returns how many compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
        return 1
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        return sum(assert_same_tensors(a[k], b[k], f"{where}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        return sum(
            assert_same_tensors(x, y, f"{where}[{i}]")
            for i, (x, y) in enumerate(zip(a, b, strict=True))
        )
    assert a == b, f"{where}: {a} != {b}"
    return 0


def metrics_without_timings(workdir: Path) -> list[dict]:
    """Each epoch's record less its clock readings (the run's timings and each rank's: the
    straggler figures, ``rank<N>_step_s`` ...) and the data audit's figures, which count the
    images the processes of each start checked (a restarted one checks its first batches
    again: it may run on another machine)."""
    history = json.loads((workdir / "logs" / "training_history.json").read_text())
    return [
        {
            k: v
            for k, v in r.items()
            if k not in TIMING_KEYS and not re.match(r"(rank\d+|audit)_", k)
        }
        for r in history["epochs"]
    ]


def latest(workdir: Path) -> dict:
    return torch.load(workdir / "checkpoints" / "checkpoint_latest.pth", weights_only=True)


def imbalanced_folder(root: Path, counts: dict[str, int]) -> Path:
    """An ImageFolder with ``counts[name]`` images of each class."""
    write_image_folder(root, list(counts), max(counts.values()), seed=1)
    for name, count in counts.items():
        for extra in sorted((root / name).iterdir())[count:]:
            extra.unlink()
    return root


@pytest.mark.slow
def test_sigkill_mid_epoch_then_torchrun_restart_is_bitwise_exact(resume_dataset, tmp_path):
    """On tar shards (training) and a folder (validation)."""
    _, val = resume_dataset
    # --sampler balanced on 36/24/12 images: 24 of each class per epoch, fox's each twice (the
    # shuffled order shares all but its epoch_order, exact on resume in the recipe test below).
    train = imbalanced_folder(tmp_path / "data" / "imbalanced", {"cat": 36, "dog": 24, "fox": 12})
    # Read from tar shards (a layout other than a folder: its index, pread by offset).
    train = pack_folder(train, tmp_path / "data" / "shards", "shards", shard_size=20)
    # --model_ema --check_sync: the replicas' EMAs agree, and the EMA resumes bitwise too.
    flags = train_flags(train, val, "--epochs", "2", "--save_every_steps", "2")
    flags += ["--model_ema", "--check_sync", "--sampler", "balanced"]
    clean = launch(tmp_path / "clean", flags)
    assert clean.returncode == 0, clean.stderr[-3000:]

    # Rank 1 is SIGKILLed after step 3 of epoch 2; the checkpoint of step 2 is the newest.
    crashed = launch(
        tmp_path / "crashed",
        [*flags, "--max_restarts", "1", "--resume", "auto"],
        env=kill_at("2:3:1"),
    )
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    log0 = (tmp_path / "crashed" / "logs" / "train_rank_0.log").read_text()
    assert (
        "killing rank 1 with SIGKILL"
        in (tmp_path / "crashed" / "logs" / "train_rank_1.log").read_text()
    )
    assert "Resumed from checkpoints/checkpoint_latest.pth: epoch 2, step 2 of 4" in log0
    assert "Training data: 72 images in 3 classes from tar shards" in log0
    # The same as events: the first attempt's survive the restart, and the launcher's launch.
    logs = tmp_path / "crashed" / "logs"
    events = json.loads((logs / "training_history.json").read_text())["events"]
    assert [e["attempt"] for e in events if e["kind"] == "start"] == [0, 1]
    (resumed,) = [e for e in events if e["kind"] == "resume"]
    assert (resumed["by"], resumed["epoch"], resumed["step"]) == ("torchrun", 2, 2)
    assert events[-1]["kind"] == "done" and events[1]["layout"] == "tar shards"
    assert [e["kind"] for e in read_events(logs / LAUNCHER_EVENTS)] == ["launch"]
    assert "restarted by torchrun: Resumed from" in (logs / "report.html").read_text()

    a, b = latest(tmp_path / "clean"), latest(tmp_path / "crashed")
    compared = assert_same_tensors(a["model_state_dict"], b["model_state_dict"], "model")
    compared += assert_same_tensors(a["optimizer_state_dict"], b["optimizer_state_dict"], "optim")
    compared += assert_same_tensors(a["model_ema_state_dict"], b["model_ema_state_dict"], "ema")
    assert a["ema_updates"] == b["ema_updates"] == 8  # 4 steps per epoch, 2 epochs
    assert a["config"]["sampler"] == b["config"]["sampler"] == "balanced"
    # The model, its EMA and the optimizer's state: more tensors than the model and EMA.
    assert compared > 2 * len(a["model_state_dict"]) and (a["epoch"], a["step"]) == (
        b["epoch"],
        b["step"],
    ) == (2, 0)
    # Every epoch once, with the same metrics as the uninterrupted run.
    assert metrics_without_timings(tmp_path / "crashed") == metrics_without_timings(
        tmp_path / "clean"
    )
    assert [r["epoch"] for r in metrics_without_timings(tmp_path / "crashed")] == [1, 2]
    # TensorBoard: the restart dropped what the killed attempt wrote after the checkpoint
    # (step 7) and wrote every step once, in order: as TensorBoard's Python loader reads the
    # files, and as they are (what its Rust data server shows).
    for purge in (True, False):
        events = read_tensorboard(logs, purge=purge)
        assert [step for step, _ in steps_and_values(events, "train/loss")] == list(range(1, 9))
        assert [step for step, _ in steps_and_values(events, "epoch/val_acc")] == [4, 8]


# Every flag of the recipe that keeps state or draws random numbers, in one run (each exact
# resume costs three tiny trainings): per-sample augmentation, per-step mixing that ends after
# epoch 1, a frozen backbone that thaws at epoch 2, the head's learning-rate scale, clipping,
# gradient accumulation and the EMA.
RECIPE_FLAGS = [
    *("--batch_size", "4", "--accum_steps", "2"),
    *("--auto_augment", "trivialaugment", "--random_erasing", "0.5"),
    *("--mixup", "0.4", "--cutmix", "1.0", "--label_smoothing", "0.1", "--mix_off_epochs", "1"),
    *("--freeze_backbone_epochs", "1", "--head_lr_scale", "5", "--clip_grad_norm", "0.5"),
    "--model_ema",
]


@pytest.mark.slow
def test_mid_epoch_resume_with_the_recipe_and_other_num_workers_is_exact(resume_dataset, tmp_path):
    """One process, killed after step 5 of epoch 1 (checkpoint at step 4), resumed with 2
    loader workers instead of 0, every recipe flag on: the same weights, optimizer, schedule and
    EMA, bitwise, and the same history as the uninterrupted run (run in this process: world
    size 1 runs the same code with or without torchrun)."""
    train, val = resume_dataset
    flags = train_flags(train, val, "--epochs", "2", "--save_every_steps", "4", *RECIPE_FLAGS)
    flags += ["--cache_images", "none"]  # the loader workers augment the files they read
    (tmp_path / "clean").mkdir()
    assert run_train(flags, cwd=tmp_path / "clean") == 0
    killed = launch(tmp_path / "resumed", flags, nproc=1, env=kill_at("1:5"))
    assert killed.returncode != 0
    assert latest(tmp_path / "resumed")["step"] == 4
    resumed = launch(
        tmp_path / "resumed", [*flags, "--resume", "auto", "--num_workers", "2"], nproc=1
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "epoch 1, step 4 of 9" in resumed.stdout
    a, b = latest(tmp_path / "clean"), latest(tmp_path / "resumed")
    for key in (
        "model_state_dict",
        "model_ema_state_dict",
        "optimizer_state_dict",
        "scheduler_state_dict",
    ):
        assert_same_tensors(a[key], b[key], key)
    assert a["ema_updates"] == b["ema_updates"] == 18  # 9 steps per epoch, 2 epochs
    assert a["effective_batch_size"] == 8
    history = metrics_without_timings(tmp_path / "resumed")
    assert metrics_without_timings(tmp_path / "clean") == history
    assert [r["epoch"] for r in history] == [1, 2] and "val_acc_ema" in history[1]


def test_corrupt_latest_falls_back_to_previous_and_the_history_drops_what_followed_it(
    trained_run, tmp_path: Path, capsys
):
    workdir = trained_run.copy_to(tmp_path)
    latest_path = workdir / "checkpoints" / "checkpoint_latest.pth"
    latest_path.write_bytes(latest_path.read_bytes()[:5000])  # a truncated write
    prev = workdir / "checkpoints" / "checkpoint_latest.prev.pth"
    assert torch.load(prev, weights_only=True)["epoch"] == 1
    capsys.readouterr()
    # The previous checkpoint holds epoch 1: epoch 2 is trained again.
    assert run_train([*trained_run.flags, "--epochs", "2", "--resume", "auto"], cwd=workdir) == 0
    out, err = capsys.readouterr()
    assert "corrupt or truncated" in out + err
    assert "falling back to the previous checkpoint" in out
    assert "Resumed from checkpoints/checkpoint_latest.pth: epoch 2, step 0" in out
    assert latest(workdir)["epoch"] == 2
    # Epoch 2 is redone, not doubled: the history keeps epoch 1's record as it was.
    history = json.loads((workdir / "logs" / "training_history.json").read_text())
    before = json.loads((trained_run.root / "logs" / "training_history.json").read_text())
    assert [r["epoch"] for r in history["epochs"]] == [1, 2]
    assert history["epochs"][0] == before["epochs"][0]


def test_corrupt_checkpoint_without_fallback_is_one_clear_error_in_process(
    tiny_dataset, tmp_path: Path, capsys
):
    """The trainer's line (the launcher passes a rank's line on: test_stops'
    ``test_bad_input_found_by_a_worker_is_one_line``), and the launcher's own check of a
    missing file."""
    train, val = tiny_dataset
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint at all")
    data = ["--device", "cpu", "--train_dir", train, "--val_dir", val]
    line = user_error_line(train_ddp.main, [*data, "--resume", bad], capsys, cwd=tmp_path)
    assert "corrupt" in line
    line = user_error_line(
        launch_ddp.main, [*data, "--resume", tmp_path / "missing.pth"], capsys, cwd=tmp_path
    )
    assert "missing.pth" in line and "no such file" in line


class _Payload:
    """Unpickling this calls open(path, "w"): a checkpoint that runs code when loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_malicious_checkpoint_is_refused_and_its_code_never_runs(
    tiny_dataset, tmp_path: Path, capsys
):
    train, val = tiny_dataset
    marker = tmp_path / "pwned.txt"
    evil = tmp_path / "evil.pth"
    torch.save({"model_state_dict": _Payload(marker), "optimizer_state_dict": {}, "epoch": 0}, evil)
    pickle.loads(pickle.dumps(_Payload(tmp_path / "probe.txt"))).close()  # the payload is live
    assert (tmp_path / "probe.txt").exists()

    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", "--train_dir", train, "--val_dir", val, "--resume", evil],
        capsys,
        cwd=tmp_path,
    )
    assert "refused to load" in line and "weights_only=True" in line
    assert not marker.exists()


def test_resume_auto_without_checkpoint_starts_fresh(tiny_dataset, tmp_path: Path, capsys):
    train, val = tiny_dataset
    flags = [*tiny_run_flags(train, val), "--epochs", "1", "--resume", "auto"]
    assert run_train(flags, cwd=tmp_path) == 0
    assert "no checkpoint in checkpoints, starting a new run" in capsys.readouterr().out
    assert latest(tmp_path)["epoch"] == 1


def run_and_other_classes(trained_run, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the trained run, and train/val folders of two classes it has never seen."""
    workdir = trained_run.copy_to(tmp_path)
    other_train = write_image_folder(tmp_path / "other" / "train", ["ant", "bee"], 8)
    other_val = write_image_folder(tmp_path / "other" / "val", ["ant", "bee"], 2)
    return workdir, other_train, other_val


def test_resume_on_other_classes_is_one_clear_error_in_process(trained_run, tmp_path: Path, capsys):
    """The trainer's line, which the launcher passes on (as test_stops'
    ``test_bad_input_found_by_a_worker_is_one_line`` checks for a rank's line)."""
    workdir, other_train, other_val = run_and_other_classes(trained_run, tmp_path)
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", *tiny_run_flags(other_train, other_val), *RESNET18, "--resume", "auto"],
        capsys,
        cwd=workdir,
    )
    assert "other classes" in line and "only in the data: ['ant', 'bee']" in line


def test_resume_with_another_optimizer_is_one_clear_error(trained_run, tmp_path: Path, capsys):
    workdir = trained_run.copy_to(tmp_path)
    history = (workdir / "logs" / "training_history.json").read_text()
    line = user_error_line(
        train_ddp.main,
        [
            "--device",
            "cpu",
            *trained_run.flags,
            "--epochs",
            "3",
            "--optimizer",
            "sgd",
            "--resume",
            "auto",
        ],
        capsys,
        cwd=workdir,
    )
    assert "--optimizer adamw" in line and "not --optimizer sgd" in line
    assert (workdir / "logs" / "training_history.json").read_text() == history


class _System:
    """Unpickles as a call of os.system: what a hostile checkpoint holds."""

    def __reduce__(self):
        return (os.system, ("true",))


class _Harmless:
    """A plain class of this module: not code, but an object weights_only cannot rebuild."""


@pytest.mark.parametrize("payload", ["os.system", "a class of ours"])
def test_a_refused_checkpoint_is_called_refused_whatever_torch_says(
    tmp_path: Path, payload, capsys
):
    """The review's F2: a pickle of ``os.system`` was called "corrupt" with torch's advice to load
    it with weights_only=False, the harmless class "refused". Both are one refused line now,
    through the evaluation tool, and torch's own advice never shows."""
    from imgtrainer.tools.evaluate import main as evaluate_main

    path = tmp_path / "evil.pth"
    value = _Harmless() if payload == "a class of ours" else _System()
    torch.save({"model_state_dict": value}, path)
    line = user_error_line(
        evaluate_main, ["--checkpoint", path, "--data_dir", tmp_path], capsys, cwd=tmp_path
    )
    assert line.startswith(f"error: refused to load {path}: it holds code or objects")
    assert "weights_only=False" not in line and "likely succeed" not in line

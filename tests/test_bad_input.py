"""Bad input: one clear error line, exit code 2, no traceback, nothing saved lost.

Most checks run the tools' ``main`` in this process (the same code as the command line, without
a new interpreter); one per tool goes through the real command line for the exit code (``slow``
where the tool imports torch)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import imgtrainer.run.launcher as launch_ddp
import imgtrainer.run.train as train_ddp
from conftest import (
    ROOT,
    SRC,
    TINY_FLAGS,
    assert_user_error,
    run_cli,
    user_error_line,
    write_image_folder,
)
from imgtrainer.config import parse_config
from imgtrainer.errors import UserError


def test_fresh_clone_without_data_suggests_demo(tmp_path: Path):
    result = run_cli([ROOT / "launch_ddp.py", "--device", "cpu"], cwd=tmp_path)
    assert_user_error(result, "data/train", "data/val", "--demo")


def test_missing_val_folder_in_process(tiny_dataset, tmp_path: Path, capsys):
    train, val = tiny_dataset
    shutil.rmtree(val)
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", "--train_dir", train, "--val_dir", val],
        capsys,
        cwd=tmp_path,
    )
    assert str(val) in line and "does not exist" in line


@pytest.mark.slow
def test_missing_val_folder(tiny_dataset, tmp_path: Path):
    """The same through the command line: exit code 2 from a new interpreter."""
    train, val = tiny_dataset
    shutil.rmtree(val)
    result = run_cli(
        [SRC / "train_ddp.py", "--device", "cpu", "--train_dir", train, "--val_dir", val],
        cwd=tmp_path,
    )
    assert_user_error(result, str(val), "does not exist")


def test_empty_train_folder(tiny_dataset, tmp_path: Path, capsys):
    train, val = tiny_dataset
    shutil.rmtree(train)
    train.mkdir()
    line = user_error_line(
        launch_ddp.main,
        ["--device", "cpu", "--nproc", "2", "--train_dir", train, "--val_dir", val],
        capsys,
        cwd=tmp_path,
    )
    assert "no class folders" in line


def test_class_folder_without_images(tiny_dataset, tmp_path: Path, capsys):
    train, val = tiny_dataset
    for image in (train / "dog").iterdir():
        image.unlink()
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", "--train_dir", train, "--val_dir", val],
        capsys,
        cwd=tmp_path,
    )
    assert "dog" in line


def test_mismatched_classes_name_both_sides(tmp_path: Path, capsys):
    train = write_image_folder(tmp_path / "train", ["cat", "dog", "owl"], 2)
    val = write_image_folder(tmp_path / "val", ["cat", "dog", "yak"], 2)
    line = user_error_line(
        launch_ddp.main,
        ["--device", "cpu", "--train_dir", train, "--val_dir", val],
        capsys,
        cwd=tmp_path,
    )
    assert "only in training: ['owl']; only in validation: ['yak']" in line


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (["--batch_size", "0"], "--batch_size must be positive, got 0"),
        (
            ["--warmup_epochs", "9", "--epochs", "2"],
            "--warmup_epochs must be between 0 and --epochs",
        ),
        (["--pretrained", "--pretrained_path", "x.pth"], "not both"),
        (["--accum_steps", "0"], "--accum_steps must be at least 1, got 0"),
    ],
)
def test_impossible_flag_values(flags, phrase):
    with pytest.raises(UserError, match=phrase):
        parse_config(flags)


def test_batch_larger_than_dataset(tiny_dataset, tmp_path: Path, capsys):
    train, val = tiny_dataset
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", "--train_dir", train, "--val_dir", val, "--batch_size", "500"],
        capsys,
        cwd=tmp_path,
    )
    assert "--batch_size 500" in line


@pytest.mark.parametrize(
    "flags, phrases",
    [
        (["--batch_size", "30"], ("48 images", "on 2 process(es)")),
        (["--sync_bn"], ("--sync_bn needs CUDA",)),
        (["--cache_images", "gpu"], ("--cache_images gpu",)),
    ],
)
def test_launcher_checks_what_workers_would_reject_before_torchrun(
    tiny_dataset, tmp_path, capsys, flags, phrases
):
    """Through the launcher, too: one line and exit 2, not a torchrun failure report. (The model
    name needs timm, so the workers check it: tests/test_stops.py.)"""
    train, val = tiny_dataset
    data = ["--device", "cpu", "--nproc", "2", "--train_dir", train, "--val_dir", val]
    line = user_error_line(launch_ddp.main, [*data, *flags], capsys, cwd=tmp_path)
    assert all(phrase in line for phrase in phrases), line


def test_pretrained_without_network_suggests_local_file(tiny_dataset, tmp_path: Path, capsys):
    train, val = tiny_dataset
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", "--train_dir", train, "--val_dir", val, "--pretrained", *TINY_FLAGS],
        capsys,
        cwd=tmp_path,
    )
    assert "--pretrained_path FILE" in line


def test_bad_input_keeps_what_was_saved(tiny_dataset, tmp_path: Path, capsys):
    """A failed start must not touch the checkpoints and history of an earlier run."""
    train, val = tiny_dataset
    saved = {
        tmp_path / "checkpoints" / "checkpoint_latest.pth": b"earlier run",
        tmp_path / "logs" / "training_history.json": b'{"epochs": []}',
    }
    for path, content in saved.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    for main in (launch_ddp.main, train_ddp.main):
        user_error_line(
            main,
            ["--device", "cpu", "--train_dir", train, "--val_dir", tmp_path / "nope"],
            capsys,
            cwd=tmp_path,
        )
        for path, content in saved.items():
            assert path.read_bytes() == content

"""Bad input: one clear error line, exit code 2, no traceback, nothing saved lost."""
from __future__ import annotations

import shutil
from pathlib import Path

from conftest import ROOT, SRC, TINY_FLAGS, assert_user_error, run_cli, write_image_folder


def test_fresh_clone_without_data_suggests_demo(tmp_path: Path):
    result = run_cli([ROOT / "launch_ddp.py", "--device", "cpu"], cwd=tmp_path)
    assert_user_error(result, "data/train", "data/val", "--demo")


def test_missing_val_folder(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    shutil.rmtree(val)
    result = run_cli([SRC / "train_ddp.py", "--device", "cpu", "--train_dir", train,
                      "--val_dir", val], cwd=tmp_path)
    assert_user_error(result, str(val), "does not exist")


def test_empty_train_folder(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    shutil.rmtree(train)
    train.mkdir()
    result = run_cli([ROOT / "launch_ddp.py", "--device", "cpu", "--nproc", "2",
                      "--train_dir", train, "--val_dir", val], cwd=tmp_path)
    assert_user_error(result, "no class folders")


def test_class_folder_without_images(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    for image in (train / "dog").iterdir():
        image.unlink()
    result = run_cli([SRC / "train_ddp.py", "--device", "cpu", "--train_dir", train,
                      "--val_dir", val], cwd=tmp_path)
    assert_user_error(result, "dog")


def test_mismatched_classes_name_both_sides(tmp_path: Path):
    train = write_image_folder(tmp_path / "train", ["cat", "dog", "owl"], 2)
    val = write_image_folder(tmp_path / "val", ["cat", "dog", "yak"], 2)
    result = run_cli([ROOT / "launch_ddp.py", "--device", "cpu", "--train_dir", train,
                      "--val_dir", val], cwd=tmp_path)
    assert_user_error(result, "missing in validation: ['owl']", "missing in training: ['yak']")


def test_impossible_flag_values(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    for flags, phrase in ((["--batch_size", "0"], "--batch_size"),
                          (["--warmup_epochs", "9", "--epochs", "2"], "--warmup_epochs"),
                          (["--pretrained", "--pretrained_path", "x.pth"], "not both")):
        result = run_cli([SRC / "train_ddp.py", "--train_dir", train, "--val_dir", val, *flags],
                         cwd=tmp_path)
        assert_user_error(result, phrase)


def test_batch_larger_than_dataset(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    result = run_cli([SRC / "train_ddp.py", "--device", "cpu", "--train_dir", train,
                      "--val_dir", val, "--batch_size", "500"], cwd=tmp_path)
    assert_user_error(result, "--batch_size 500")


def test_launcher_checks_what_workers_would_reject_before_torchrun(tiny_dataset, tmp_path):
    """Through the launcher, too: one line and exit 2, not a torchrun failure report. (The model
    name needs timm, so the workers check it: tests/test_stops.py.)"""
    train, val = tiny_dataset
    data = ["--device", "cpu", "--nproc", "2", "--train_dir", train, "--val_dir", val]
    for flags, phrases in ((["--batch_size", "30"], ("48 images", "on 2 process(es)")),
                           (["--sync_bn"], ("--sync_bn needs CUDA",)),
                           (["--cache_images", "gpu"], ("--cache_images gpu",))):
        result = run_cli([ROOT / "launch_ddp.py", *data, *flags], cwd=tmp_path)
        assert_user_error(result, *phrases)


def test_pretrained_without_network_suggests_local_file(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    result = run_cli([SRC / "train_ddp.py", "--device", "cpu", "--train_dir", train,
                      "--val_dir", val, "--pretrained", *TINY_FLAGS], cwd=tmp_path, timeout=60)
    assert_user_error(result, "--pretrained_path FILE")


def test_bad_input_keeps_what_was_saved(tiny_dataset, tmp_path: Path):
    """A failed start must not touch the checkpoints and history of an earlier run."""
    train, val = tiny_dataset
    saved = {tmp_path / "checkpoints" / "checkpoint_latest.pth": b"earlier run",
             tmp_path / "logs" / "training_history.json": b'{"epochs": []}'}
    for path, content in saved.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    result = run_cli([ROOT / "launch_ddp.py", "--device", "cpu", "--train_dir", train,
                      "--val_dir", tmp_path / "nope"], cwd=tmp_path)
    assert_user_error(result)
    for path, content in saved.items():
        assert path.read_bytes() == content

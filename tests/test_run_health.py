"""Runs that go wrong in ways users meet: a loss that is no longer finite (stop every rank with
one line, exit 1, save nothing non-finite), a disk that fills inside torch.save's zip writer,
and a console that is not a terminal (plain lines, no carriage returns)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import imgtrainer.checkpoints.files as checkpoint
import imgtrainer.files as files
from conftest import ROOT, TINY_FLAGS, run_train
from imgtrainer.checkpoints.writer import CheckpointWriter
from imgtrainer.errors import RunFailed, UserError
from imgtrainer.training.loop import ProgressBar
from imgtrainer.training.nonfinite import NONFINITE_STEPS, NonFiniteLoss

NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------------------- non-finite loss


def feed(guard: NonFiniteLoss, losses: list[float]) -> None:
    for step, loss in enumerate(losses, start=1):
        guard.update(torch.tensor(loss, dtype=torch.float64), step)


def test_a_few_nonfinite_losses_in_a_row_stop_the_run_naming_the_first():
    assert NONFINITE_STEPS == 3
    guard = NonFiniteLoss(torch.device("cpu"), distributed=False)
    # Two in a row (a float16 overflow the scaler skips, twice) pass; the check is free of
    # side effects until a run of three.
    feed(guard, [1.0, NAN, INF, 0.9, NAN, 0.8])
    guard.check(steps_per_epoch=4)
    feed(guard, [1.0] * 6 + [NAN, INF, NAN, NAN, 1.0])  # steps 7, 8, 9: the first run of three
    with pytest.raises(RunFailed) as err:
        guard.check(steps_per_epoch=4)
    line = str(err.value)
    assert "for 3 optimizer steps in a row from step 7 (epoch 2, step 3 of 4) on rank 0" in line
    assert "--amp_dtype bfloat16" in line and "--clip_grad_norm" in line
    assert "--learning_rate" in line and "--resume auto" in line and "\n" not in line


def test_checkpoints_refuse_nonfinite_weights_and_keep_the_last_good_ones(tmp_path: Path):
    writer = CheckpointWriter(tmp_path, enabled=True)
    good = {"model_state_dict": {"w": torch.ones(3)}, "model_ema_state_dict": None}
    writer.save(good, is_best=True)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for key in ("model_state_dict", "model_ema_state_dict"):
        bad = {**good, key: {"w": torch.ones(3), "bn.running_var": torch.tensor([1.0, NAN])}}
        with pytest.raises(RunFailed, match=r"hold NaN or inf \(bn.running_var\)"):
            writer.save(bad, is_best=True)
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_diverging_run_exits_1_with_one_line_and_keeps_its_last_good_checkpoint(
    tiny_dataset, tmp_path: Path, capsys
):
    """Epoch 2's learning rate (0.01 x 1e8) blows the loss up: the run stops with one line,
    exit 1, before saving anything non-finite: the latest checkpoint, where --resume auto
    continues, is still epoch 1's."""
    train, val = tiny_dataset
    flags = ["--train_dir", train, "--val_dir", val, *TINY_FLAGS, "--model", "test_resnet"]
    flags += ["--optimizer", "sgd", "--scheduler", "step", "--step_size", "1", "--epochs", "2"]
    flags += ["--batch_size", "16", "--no_tensorboard"]
    capsys.readouterr()
    code = run_train([*flags, "--gamma", "1e8"], tmp_path)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in out + err, (code, out, err)
    assert "NaN or inf" in lines[0] and "--resume auto continues" in lines[0]
    latest = tmp_path / "checkpoints" / "checkpoint_latest.pth"
    ckpt = torch.load(latest, weights_only=True)
    assert (ckpt["epoch"], ckpt["step"]) == (1, 0)
    assert all(torch.isfinite(t).all() for t in ckpt["model_state_dict"].values())
    history = json.loads((tmp_path / "logs" / "training_history.json").read_text())
    assert [r["epoch"] for r in history["epochs"]] == [1]
    # The history's events end with why, though the line went to stderr, not to the log.
    stop = history["events"][-1]
    assert (stop["kind"], stop["reason"], stop["code"]) == ("stop", "nonfinite", 1)
    assert stop["text"] == lines[0] and stop["finished"] is False


# ----------------------------------------------------------------------------- a full disk

ZIP_WRITER_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def zip_writer_fails(obj, f):
    """What torch.save does on a full file system: part of the file, then a RuntimeError."""
    f.write(b"\0" * 4096)
    raise RuntimeError(ZIP_WRITER_FULL)


def test_a_full_disk_inside_torch_saves_zip_writer_is_one_line(tmp_path: Path, monkeypatch):
    writer = CheckpointWriter(tmp_path, enabled=True)
    writer.save({"model_state_dict": {"w": torch.zeros(10)}}, is_best=True)
    writer.save({"model_state_dict": {"w": torch.ones(10)}}, is_best=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(checkpoint.torch, "save", zip_writer_fails)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage._replace(free=3 << 20))
    state = {"model_state_dict": {"w": torch.zeros(3, 1024, 1024)}}  # 12 MiB
    with pytest.raises(UserError) as err:
        writer.save(state, is_best=True)
    assert str(err.value).startswith(f"no space left on the device to write {writer.latest}")
    assert "needs about 12.0 MiB, 3.0 MiB are free there" in str(err.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # With room enough, the same error is not a full disk: it keeps its traceback.
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage._replace(free=1 << 40))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        writer.save(state, is_best=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


FULL_DISK_SCRIPT = """
import sys, torch
from pathlib import Path
from imgtrainer.checkpoints.writer import CheckpointWriter
from imgtrainer.errors import UserError
writer = CheckpointWriter(Path(sys.argv[1]), enabled=True)
writer.save({"model_state_dict": {"w": torch.zeros(1000)}}, is_best=True)
try:
    writer.save({"model_state_dict": {"w": torch.zeros(3, 1024, 1024)}}, is_best=True)
except UserError as err:
    print(err)
"""


@pytest.mark.slow
def test_a_real_full_file_system(tmp_path: Path):
    """A 2 MiB tmpfs mounted in a user namespace (no root needed where the kernel allows it)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    mount = tmp_path / "small"
    mount.mkdir()
    script = (
        f"mount -t tmpfs -o size=2m tmpfs {mount} && "
        f"PYTHONPATH={ROOT / 'src'} {sys.executable} -c '{FULL_DISK_SCRIPT}' {mount} && ls {mount}"
    )
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120
    )
    if "mount" in result.stderr and result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    line, *listing = result.stdout.splitlines()
    assert line.startswith(f"no space left on the device to write {mount}/checkpoint_latest.pth")
    assert "needs about 12.0 MiB" in line and "are free there" in line
    assert listing == ["checkpoint_best.pth", "checkpoint_latest.pth"]


# ----------------------------------------------------------------------------- the console


def test_the_progress_bar_is_plain_lines_where_the_console_is_no_terminal(caplog):
    bar = ProgressBar(enabled=True, description="epoch 1/2", terminal=False)
    metrics = {"train_loss": 0.5, "train_acc": 0.75, "lr": 0.01, "images_per_sec": 12.0}
    with caplog.at_level(logging.INFO, logger="imgtrainer"):
        for step, _ in enumerate(bar.wrap(range(4), start_step=2), start=3):
            if step % 2 == 0:
                bar.on_log_step(step, {**metrics, "data_wait_share": 0.0})
    bar.close()
    assert bar.bar is None
    assert [r.getMessage() for r in caplog.records] == [
        "epoch 1/2 step 4/6  loss 0.5000  acc 0.7500  lr 1.00e-02  12 img/s",
        "epoch 1/2 step 6/6  loss 0.5000  acc 0.7500  lr 1.00e-02  12 img/s",
    ]
    assert ProgressBar(enabled=True, terminal=True).wrap(range(3), 0) is not None

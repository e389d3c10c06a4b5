"""tests/support's own logic on the CPU: the data sets the CUDA checks and the benchmarks write
(their photos: tests/test_gpu_cache_canvas.py), and how a launcher run in its own folder is
stopped and read back."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT
from support.folder_runs import (
    Run,
    checkpoint_differences,
    expect_finished,
    finish,
    kill_and_resume_problem,
    run_command,
)
from support.harness import write_split_folder


def sizes_of(folder) -> list[tuple[int, int]]:
    sizes = []
    for path in sorted(folder.rglob("*.jpg")):
        with Image.open(path) as image:
            sizes.append(image.size)
    return sizes


def test_the_split_folder_holds_square_patches_one_colour_per_class(tmp_path):
    data = write_split_folder(tmp_path / "patches", 2, 3, 1, 24, noise=40, threads=2)
    assert sorted(p.name for p in (data / "train").iterdir()) == ["class_00", "class_01"]
    assert sizes_of(data / "train") == [(24, 24)] * 6 and sizes_of(data / "val") == [(24, 24)] * 2
    means = [
        np.asarray(Image.open(data / "train" / name / "img_000.jpg"), dtype=float).mean((0, 1))
        for name in ("class_00", "class_01")
    ]
    assert np.abs(means[0] - means[1]).max() > 100  # red against green: learnable
    again = write_split_folder(tmp_path / "again", 2, 3, 1, 24, noise=40, threads=1)
    same = [
        (data / split / "class_01" / "img_000.jpg").read_bytes()
        == (again / split / "class_01" / "img_000.jpg").read_bytes()
        for split in ("train", "val")
    ]
    assert same == [True, True]  # the same files for the same arguments
    # train and val are drawn with different seeds: not copies of each other
    assert (data / "train" / "class_00" / "img_000.jpg").read_bytes() != (
        data / "val" / "class_00" / "img_000.jpg"
    ).read_bytes()


# ----------------------------------------------------------------------------- folder runs


def a_run(folder: Path, code: int, losses: list[float], **history) -> Run:
    """A run of ``folder`` that ended with ``code`` and wrote an epoch record per loss."""
    records = [
        {
            "epoch": epoch,
            "train_loss": loss,
            "val_loss": loss,
            "val_acc": 0.5,
            "train_images_per_sec": 9.0,
            "peak_memory_mb": 100.0,
        }
        for epoch, loss in enumerate(losses, 1)
    ]
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    text = json.dumps({**history, "epochs": records})
    (folder / "logs" / "training_history.json").write_text(text)
    return Run(folder, code, 3.0, "", "Traceback ...\nRuntimeError: boom\n")


def test_a_finished_run_is_read_from_what_it_wrote(tmp_path):
    figures = expect_finished(a_run(tmp_path, 0, [1.0, 0.5]), 2)
    assert figures == {"val_acc": 0.5, "img/s": 9.0, "peak MiB": 100.0, "run s": 3.0}
    with pytest.raises(AssertionError, match="exit code 1: .*RuntimeError: boom"):
        expect_finished(a_run(tmp_path, 1, [1.0]), 1)
    with pytest.raises(AssertionError, match="1 epochs, expected 2"):
        expect_finished(a_run(tmp_path, 0, [1.0]), 2)
    with pytest.raises(AssertionError, match="non-finite"):
        expect_finished(a_run(tmp_path, 0, [1.0, float("nan")]), 2)

    command = run_command(tmp_path / "r", tmp_path / "data", ["--use_amp"], gpus=2)
    assert command[1:6] == [str(ROOT / "launch_ddp.py"), "--device", "cuda", "--num_gpus", "2"]
    assert command[command.index("--train_dir") + 1] == str(tmp_path / "data" / "train")
    assert str(tmp_path / "r" / "checkpoints") in command and command[-1] == "--use_amp"
    on_cpu = run_command(tmp_path / "r", tmp_path / "data", [], gpus=2, device="cpu")
    assert on_cpu[2:6] == ["--device", "cpu", "--nproc", "2"]


def test_a_run_past_its_time_is_stopped(tmp_path):
    (tmp_path / "stdout.txt").write_text("started\n")
    (tmp_path / "stderr.txt").write_text("")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    process = subprocess.Popen(sleeper, start_new_session=True)
    run = finish(process, tmp_path, started, timeout=0.2)
    assert run.returncode == -signal.SIGTERM and run.seconds < 30
    assert run.stdout == "started\n" and run.tail() == "started"


def test_checkpoints_are_compared_tensor_by_tensor_bitwise():
    a = {
        "model_state_dict": {"w": torch.ones(2), "b": torch.zeros(1)},
        "optimizer_state_dict": {"state": {0: {"step": torch.tensor(3.0)}}},
    }
    assert checkpoint_differences(a, copy.deepcopy(a)) == (3, [])
    b = copy.deepcopy(a)
    b["model_state_dict"]["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    del b["optimizer_state_dict"]["state"][0]["step"]
    assert checkpoint_differences(a, b) == (3, ["w", "0.step"])
    b = copy.deepcopy(a)
    b["model_state_dict"]["b"] = torch.zeros(1, dtype=torch.float64)  # equal values, not bitwise
    assert checkpoint_differences(a, b) == (3, ["b"])


def test_a_kill_and_its_resume_are_read_from_the_logs(tmp_path):
    run = a_run(tmp_path, 0, [1.0, 0.9], world_size=2)
    logs = tmp_path / "logs"

    def problem(found: Run) -> str:
        return kill_and_resume_problem(
            found, killed_rank=1, resumed_at="epoch 2, step 4 of 6", epochs=2
        )

    assert "not killed" in problem(run)
    (logs / "train_rank_1.log").write_text("TRAIN_DDP_KILL_AT: killing rank 1 with SIGKILL at\n")
    assert "no resume at epoch 2, step 4 of 6" in problem(run)
    (logs / "train_rank_0.log").write_text("Resumed from c.pth: epoch 2, step 4 of 6 (...)\n")
    assert problem(run) == ""
    repeated = a_run(tmp_path, 0, [1.0, 0.9, 0.8])
    history = json.loads((logs / "training_history.json").read_text())
    history["epochs"][2]["epoch"] = 2  # epoch 2 written twice: the resume repeated it
    (logs / "training_history.json").write_text(json.dumps(history))
    assert "epochs [1, 2, 2]" in problem(repeated)


def test_phone_photos_are_a_share_of_the_photos_at_12_and_24_megapixels(tmp_path: Path):
    from support.harness import PHONE_SIZES, write_photo_folder

    folder = write_photo_folder(tmp_path / "p", 1, 4, 64, panorama=False, phones=2, threads=2)
    sizes = [Image.open(path).size for path in sorted(folder.rglob("*.jpg"))]
    assert sizes[1] == PHONE_SIZES[0] and sizes[3] == PHONE_SIZES[1]  # every 2nd: 12 MP, 24 MP
    assert max(sizes[0]) < 1000 and max(sizes[2]) < 1000

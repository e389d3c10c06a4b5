"""Every way a launcher run ends, through the real launcher with 2 CPU processes and loader workers:
a signal stops it at an agreed step with a checkpoint and the code 130/143, a worker's bad input is
one line and exit 2, and a killed launcher leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    ROOT,
    TINY_FLAGS,
    assert_user_error,
    held_until_stopped,
    run_cli,
    start_launcher,
    write_image_folder,
)
from support.harness import descendants

pytestmark = pytest.mark.slow

# 120 train images, batch 4 on 2 processes: 15 steps per epoch, a few seconds, enough to signal
# the run in the middle of its first epoch. timm's small ResNet (0.4 M parameters): a step and
# its checkpoint cost a fraction of resnet18's, and how a run ends does not depend on the model.
STOP_FLAGS = [
    *TINY_FLAGS,
    "--model",
    "test_resnet",
    "--batch_size",
    "4",
    "--num_workers",
    "2",
    "--cache_images",
    "none",
    "--save_every_steps",
    "1",
    "--epochs",
    "2",
    "--device",
    "cpu",
    "--nproc",
    "2",
]
NOISE = ("Traceback", "ChildFailedError", "SignalException", "torch.distributed.elastic")


@pytest.fixture
def stop_dataset(tmp_path: Path) -> list[str]:
    """3 classes, plus a __MACOSX folder and a hidden folder that must not become classes."""
    classes = ["cat", "dog", "fox"]
    train = write_image_folder(tmp_path / "data" / "train", classes, 40, seed=1)
    val = write_image_folder(tmp_path / "data" / "val", classes, 4, seed=2)
    for root in (train, val):
        (root / "__MACOSX" / "cat").mkdir(parents=True)
        (root / "__MACOSX" / "cat" / "._img_000.jpg").write_bytes(b"\x00\x05\x16\x07 not a jpeg")
        (root / ".cache").mkdir()
    return ["--train_dir", str(train), "--val_dir", str(val)]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """The launcher, its ranks held after each step until they are signalled."""
    return start_launcher(args, cwd, env={"PYTHONUNBUFFERED": "1", **held_until_stopped()})


def inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def wait_for_file(
    path: Path, process: subprocess.Popen, timeout: float = 120, before: int | None = None
) -> None:
    """Wait until the run wrote ``path`` (a checkpoint written inside the first epoch); with
    ``before`` (the inode of the file an earlier run left there), until it wrote it again (a
    checkpoint replaces the file: a new inode)."""
    deadline = time.monotonic() + timeout
    while inode(path) in (None, before):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never (re)written"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has stopped; only its parent's wait is missing


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def wait_for_loader_workers(launcher: subprocess.Popen, timeout: float = 30) -> list[int]:
    """The launcher's descendants once the ranks' loader workers run (launcher, torchrun, 2
    ranks, 2 loader workers each: 6 below the launcher)."""
    deadline = time.monotonic() + timeout
    while len(pids := descendants(launcher.pid)) < 6:
        assert time.monotonic() < deadline, pids
        time.sleep(0.05)
    return pids


def assert_clean(out: str, err: str) -> None:
    for noise in NOISE:
        assert noise not in out + err, (noise, out, err)


def saved_step(checkpoint: Path) -> tuple[int, int]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return state["epoch"], state["step"]


def test_sigterm_then_sigint_to_the_launcher_each_save_and_resume(stop_dataset, tmp_path: Path):
    """SIGTERM to a new run, then SIGINT to its resumed run (one run for both signals: a
    launcher start fewer): each stops inside the first epoch at an agreed step with a
    checkpoint and the code 143 or 130, the next start resumes there, and the last finishes."""
    latest = tmp_path / "checkpoints" / "checkpoint_latest.pth"
    run = [*STOP_FLAGS, *stop_dataset]
    step = 0
    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        before = inode(latest)
        launcher = start([*run, "--resume", "auto"] if step else run, tmp_path)
        wait_for_file(latest, launcher, before=before)  # a checkpoint of this start
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=120)
        assert launcher.returncode == code, (out, err)
        assert_clean(out, err)
        assert f"Received {signal.Signals(signum).name}" in out
        assert "Resume with the same command plus --resume" in out
        assert "Report: logs/report.html (" in out  # a stopped run's page too
        assert "Stopped at epoch 1, step" in (tmp_path / "logs" / "report.html").read_text()
        history = json.loads((tmp_path / "logs" / "training_history.json").read_text())
        stop, name = history["events"][-1], signal.Signals(signum).name
        assert (stop["kind"], stop["reason"], stop["signal"]) == ("stop", "signal", name), stop
        if step:
            assert f"checkpoint_latest.pth: epoch 1, step {step} of 15" in out
        epoch, stopped = saved_step(latest)
        # Stopped inside the first epoch, at an agreed step (after the one it resumed at).
        assert epoch == 0 and step < stopped < 15, (step, stopped)
        for rank in (0, 1):  # both ranks stopped cleanly, at that step
            log = (tmp_path / "logs" / f"train_rank_{rank}.log").read_text()
            assert f"Stopped at epoch 1, step {stopped}" in log, log[-2000:]
        step = stopped
        assert "on 3 classes" in out  # __MACOSX and .cache are not classes

    # Checkpoints at the epochs' ends only, from here on: the step-wise saving was checked
    # above, and a save per step would take much of this test's time.
    resume = [*run, "--resume", "auto", "--save_every_steps", "0"]
    resumed = run_cli([ROOT / "launch_ddp.py", *resume], cwd=tmp_path)
    assert resumed.returncode == 0, (resumed.stdout, resumed.stderr)
    assert f"checkpoint_latest.pth: epoch 1, step {step} of 15" in resumed.stdout
    assert saved_step(latest) == (2, 0)
    history = json.loads((tmp_path / "logs" / "training_history.json").read_text())
    assert [r["epoch"] for r in history["epochs"]] == [1, 2]  # each epoch once


def test_sigterm_to_every_process_of_the_job(stop_dataset, tmp_path: Path):
    """What SLURM and Kubernetes do before preemption: SIGTERM to the launcher, torchrun, the
    ranks and their loader workers at once."""
    latest = tmp_path / "checkpoints" / "checkpoint_latest.pth"
    launcher = start([*STOP_FLAGS, *stop_dataset], tmp_path)
    wait_for_file(latest, launcher)
    pids = wait_for_loader_workers(launcher)
    # On the CPU the ranks are forks of torchrun's agent (which imported the trainer once), not
    # fresh "python train_ddp.py" processes: they share its command line.
    agent = [pid for pid in pids if parent(pid) == launcher.pid]
    ranks = [pid for pid in pids if agent and parent(pid) == agent[0]]
    assert len(agent) == 1 and len(ranks) == 2, [(pid, parent(pid)) for pid in pids]
    assert "--preload imgtrainer.run.train" in command_line(agent[0])
    assert all(command_line(rank) == command_line(agent[0]) for rank in ranks)
    for pid in [launcher.pid, *pids]:
        os.kill(pid, signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, (out, err)
    assert_clean(out, err)
    assert "Resume with the same command plus --resume" in out
    assert saved_step(latest)[1] > 0


def test_killed_launcher_leaves_no_process_behind(stop_dataset, tmp_path: Path):
    launcher = start([*STOP_FLAGS, *stop_dataset], tmp_path)
    wait_for_file(tmp_path / "checkpoints" / "checkpoint_latest.pth", launcher)
    pids = wait_for_loader_workers(launcher)
    launcher.kill()
    launcher.communicate(timeout=10)
    deadline = time.monotonic() + 30
    while [pid for pid in pids if alive(pid)]:
        assert time.monotonic() < deadline, [pid for pid in pids if alive(pid)]
        time.sleep(0.1)


def test_bad_input_found_by_a_worker_is_one_line(stop_dataset, tmp_path: Path):
    """A corrupt checkpoint is only found when a rank loads it with torch: the launcher prints
    that rank's line, not torchrun's report."""
    checkpoint = tmp_path / "checkpoints" / "checkpoint_latest.pth"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"not a checkpoint")
    result = run_cli(
        [ROOT / "launch_ddp.py", *STOP_FLAGS, *stop_dataset, "--resume", "auto"], cwd=tmp_path
    )
    assert_user_error(result, "rank ", "checkpoint_latest.pth", "torchrun.log")
    assert_clean(result.stdout, result.stderr)
    assert "ChildFailedError" in (tmp_path / "logs" / "torchrun.log").read_text()

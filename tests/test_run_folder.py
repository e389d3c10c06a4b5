"""A run owns its checkpoint folder: the lock, the guard against replacing an earlier run's
results, resume checks of the schedule flags (and --resume_override), and a full disk."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import imgtrainer.checkpoints.files as checkpoint
import imgtrainer.files as run_folder
import imgtrainer.reports.history as history
from conftest import SRC, run_cli, tiny_run_flags
from imgtrainer.checkpoints.files import atomic_save, previous_path
from imgtrainer.checkpoints.resume import (
    apply_optimisation_settings,
    changed_settings,
    check_resume_settings,
    optimisation_settings,
)
from imgtrainer.checkpoints.run_folder import (
    FolderBusy,
    FolderLock,
    check_new_run,
    claim_run_folder,
)
from imgtrainer.checkpoints.writer import CheckpointWriter
from imgtrainer.config import TrainConfig, parse_config
from imgtrainer.errors import UserError

# ----------------------------------------------------------------------------- the lock


def lock_holder(folder: Path) -> str | None:
    """The holder a run starting in ``folder`` would meet (FolderBusy's line names it), or
    None when it would take the lock."""
    try:
        with FolderLock(folder):
            return None
    except FolderBusy as err:
        return str(err)


def test_lock_is_exclusive_names_its_holder_and_is_released(tmp_path: Path):
    folder = tmp_path / "ckpt"
    with FolderLock(folder):
        # A second lock in this very process is refused too (the file is not opened again: that
        # would drop a POSIX lock).
        with pytest.raises(FolderBusy, match=rf"{folder} is in use .*pid {os.getpid()} on host"):
            FolderLock(folder).acquire()
        assert f"pid {os.getpid()}" in lock_holder(folder)
        with pytest.raises(UserError, match="in use by another run"):
            with claim_run_folder(folder, None, enabled=True):
                pytest.fail("a second run must not start")
    assert lock_holder(folder) is None
    with FolderLock(folder):  # free again
        pass


HOLDER = """
import ctypes, os, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from imgtrainer.checkpoints.run_folder import FolderLock

FolderLock(Path(sys.argv[2])).acquire()
# As a rank forks a loader worker; libc's fork runs none of Python's at-fork code, as in a child
# wedged at its birth by CPython's fork deadlock (gh-112275, before 3.11.8).
child = ctypes.CDLL(None).fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print("locked", child, flush=True)
time.sleep(60)
"""


def test_lock_of_a_killed_process_is_free_at_once(tmp_path: Path):
    """The kernel drops the lock with its process, so a crash never leaves a folder stuck; a
    child it forked (a loader worker that outlives its rank, however briefly) does not keep it,
    so torchrun's restarted workers find the folder free."""
    folder = tmp_path / "ckpt"
    command = [sys.executable, "-c", HOLDER, str(SRC), str(folder)]
    holder = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        word, child = holder.stdout.readline().split()
        assert word == "locked"
        assert f"pid {holder.pid} " in lock_holder(folder)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert lock_holder(folder) is None  # the forked child still lives
    finally:
        holder.kill()
        holder.wait(timeout=30)
        if child is not None:
            os.kill(int(child), signal.SIGKILL)


def test_checkpoint_dir_that_is_a_file_is_one_clear_error(tmp_path: Path):
    not_a_folder = tmp_path / "notes.txt"
    not_a_folder.write_text("mine")
    with pytest.raises(UserError, match="notes.txt is a file, not a folder"):
        FolderLock(not_a_folder).acquire()
    assert not_a_folder.read_text() == "mine"


def test_the_main_process_decides_and_every_rank_raises_its_line(tmp_path: Path):
    """claim_run_folder shares rank 0's verdict through ``agree`` (a collective in the trainer):
    rank 0 and a rank that looked at nothing raise the same line, and rank 0 does not keep the
    lock when it refuses."""
    folder = tmp_path / "ckpt"
    verdicts = []

    def agree(error):  # what all_gather_objects(error)[0] returns on every rank
        verdicts.append(error)
        return verdicts[0]

    (folder).mkdir()
    (folder / "checkpoint_latest.pth").write_bytes(b"earlier run")
    new_run = partial(check_new_run, folder, tmp_path / "logs", None, False)
    with pytest.raises(UserError, match="a new run would replace") as rank0:
        with claim_run_folder(folder, new_run, enabled=True, agree=agree):
            pytest.fail("rank 0 must not start")
    with pytest.raises(UserError) as rank1:
        with claim_run_folder(folder, new_run, enabled=False, agree=agree):
            pytest.fail("rank 1 must not start")
    assert str(rank0.value) == str(rank1.value) and verdicts[1] is None
    assert lock_holder(folder) is None
    resumed = partial(check_new_run, folder, tmp_path / "logs", "auto", False)
    with claim_run_folder(folder, resumed, enabled=True):
        assert f"pid {os.getpid()}" in lock_holder(folder)
    assert lock_holder(folder) is None


# ----------------------------------------------------------------------------- earlier results


def test_new_run_in_a_used_folder_is_refused_with_the_choices(tmp_path: Path):
    ckpt, logs = tmp_path / "checkpoints", tmp_path / "logs"
    check_new_run(ckpt, logs, None, False)  # nothing there yet
    ckpt.mkdir()
    logs.mkdir()
    (ckpt / "checkpoint_latest.pth").write_bytes(b"x")
    (logs / "training_history.json").write_text("{}")
    with pytest.raises(UserError) as err:
        check_new_run(ckpt, logs, None, False)
    message = str(err.value)
    for phrase in (
        "checkpoint_latest.pth",
        "training_history.json",
        "--resume auto",
        "--overwrite",
        "another --checkpoint_dir and --log_dir",
    ):
        assert phrase in message
    check_new_run(ckpt, logs, "auto", False)  # continues it
    check_new_run(ckpt, logs, str(ckpt / "checkpoint_latest.pth"), False)  # continues it
    check_new_run(ckpt, logs, None, True)  # starts over
    with pytest.raises(UserError, match="another folder"):
        check_new_run(ckpt, logs, str(tmp_path / "elsewhere.pth"), False)
    # Another --checkpoint_dir alone would still replace the history in --log_dir.
    with pytest.raises(UserError, match="training_history.json.*another --log_dir$"):
        check_new_run(tmp_path / "other", logs, "auto", False)
    # A best checkpoint alone is not something --resume auto continues from.
    (ckpt / "checkpoint_latest.pth").rename(ckpt / "checkpoint_best.pth")
    with pytest.raises(UserError, match="found no checkpoint to continue"):
        check_new_run(ckpt, tmp_path / "other_logs", "auto", False)


def test_overwrite_and_demo_flags():
    with pytest.raises(UserError, match="--overwrite starts a new run"):
        parse_config(["--overwrite", "--resume", "auto"])
    with pytest.raises(UserError, match="--resume_override applies new flags"):
        parse_config(["--resume_override"])
    demo = parse_config(["--demo"])
    assert (demo.checkpoint_dir, demo.log_dir, demo.overwrite) == (
        "checkpoints/demo",
        "logs/demo",
        True,
    )
    # The demo starts over only in its own folders, never when asked to resume.
    assert not parse_config(["--demo", "--resume", "auto"]).overwrite
    assert not parse_config(["--demo", "--checkpoint_dir", "mine"]).overwrite
    assert parse_config(["--demo", "--checkpoint_dir", "mine", "--overwrite"]).overwrite
    assert not parse_config(["--demo", "--no_overwrite"]).overwrite


def test_overwrite_removes_the_earlier_run_at_its_first_save_not_before(tmp_path: Path):
    writer = CheckpointWriter(tmp_path, enabled=True, replace_previous_run=True)
    for path in (writer.latest, writer.best, previous_path(writer.latest)):
        path.write_bytes(b"earlier run")
    writer.save({"epoch": torch.tensor(1)}, is_best=False)
    assert torch.load(writer.latest, weights_only=True)["epoch"] == 1
    assert not writer.best.exists() and not previous_path(writer.latest).exists()
    writer.save({"epoch": torch.tensor(2)}, is_best=True)  # then the usual policy
    assert torch.load(previous_path(writer.latest), weights_only=True)["epoch"] == 1
    assert torch.load(writer.best, weights_only=True)["epoch"] == 2


def test_best_is_a_second_name_of_latest_until_latest_is_replaced(tmp_path: Path, monkeypatch):
    writer = CheckpointWriter(tmp_path, enabled=True)
    writer.save({"epoch": torch.tensor(1)}, is_best=True)
    assert writer.best.samefile(writer.latest)  # written once, not serialized twice
    writer.save({"epoch": torch.tensor(2)}, is_best=False)
    assert torch.load(writer.best, weights_only=True)["epoch"] == 1
    assert torch.load(writer.latest, weights_only=True)["epoch"] == 2
    assert torch.load(previous_path(writer.latest), weights_only=True)["epoch"] == 1

    def no_links(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(run_folder.os, "link", no_links)  # a file system without hard links
    writer.save({"epoch": torch.tensor(3)}, is_best=True)
    assert not writer.best.samefile(writer.latest)
    assert torch.load(writer.best, weights_only=True)["epoch"] == 3
    assert not list(tmp_path.glob(".*.tmp"))


# ----------------------------------------------------------------------------- a full disk


def fail_after_writing(nbytes: int):
    """A stand-in for torch.save that writes part of the file, then finds the disk full."""

    def save(obj, f):
        f.write(b"\0" * nbytes)
        raise OSError(errno.ENOSPC, "No space left on device")

    return save


def test_disk_full_is_one_line_and_keeps_the_previous_checkpoints(tmp_path: Path, monkeypatch):
    writer = CheckpointWriter(tmp_path, enabled=True)
    writer.save({"w": torch.zeros(10)}, is_best=True)
    writer.save({"w": torch.ones(10)}, is_best=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {
        "checkpoint_latest.pth",
        "checkpoint_latest.prev.pth",
        "checkpoint_best.pth",
    }
    monkeypatch.setattr(checkpoint.torch, "save", fail_after_writing(1000))
    state = {"model": {"w": torch.zeros(3, 1024, 1024)}}  # 12 MiB of float32
    with pytest.raises(UserError) as err:
        writer.save(state, is_best=True)
    message = str(err.value)
    assert str(writer.latest) in message and "no space left" in message
    assert "needs about 12.0 MiB" in message and "are free there" in message
    assert "\n" not in message
    # The partial temporary file is gone; latest, its fallback and best are untouched.
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    atomic_save({"w": torch.zeros(1)}, tmp_path / "ok.pth")  # a later write works as usual
    assert not list(tmp_path.glob(".*.tmp"))


def test_disk_full_while_writing_the_history(tmp_path: Path, monkeypatch):
    path = tmp_path / "training_history.json"
    writer = history.HistoryWriter(path, {"config": {}}, enabled=True)
    writer.append({"epoch": 1})
    writer.save()
    before = path.read_text()
    writer.append({"epoch": 2})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("imgtrainer.files.os.fsync", full)
    with pytest.raises(UserError, match=r"training_history.json: it needs about \d+ B"):
        writer.save()
    assert path.read_text() == before and not (tmp_path / ".training_history.json.tmp").exists()


class QuotaFile(io.FileIO):
    """A file on a folder with free space whose quota is full after ``room`` bytes."""

    def __init__(self, path, mode: str, room: int):
        super().__init__(path, mode)
        self.room = room

    def write(self, data) -> int:
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return super().write(data)


@pytest.mark.parametrize("room", [0, 1000, 100_000])
def test_a_full_quota_inside_torch_save_is_one_line(tmp_path: Path, monkeypatch, room: int):
    writer = CheckpointWriter(tmp_path, enabled=True)
    writer.save({"w": torch.zeros(10)}, is_best=True)
    writer.save({"w": torch.ones(10)}, is_best=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    files = []

    def quota_open(path, mode):
        files.append(path)
        return io.BufferedWriter(QuotaFile(path, mode, room))

    # The real torch.save: past its first records it reports the failed write as a
    # RuntimeError ("unexpected pos ..."), while the folder shows plenty of free space.
    monkeypatch.setattr(run_folder, "new_file", lambda path: quota_open(path, "wb"))
    plenty = SimpleNamespace(total=1 << 40, used=0, free=1 << 40)
    monkeypatch.setattr(run_folder.shutil, "disk_usage", lambda folder: plenty)
    with pytest.raises(UserError) as err:
        writer.save({"model": {"w": torch.zeros(64, 1024)}}, is_best=True)  # 256 KiB
    message = str(err.value)
    assert str(writer.latest) in message and "needs about 256.0 KiB" in message
    assert "1024.0 GiB are free there but a disk quota" in message and "\n" not in message
    assert files and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_other_runtime_errors_of_torch_save_keep_their_traceback(tmp_path: Path, monkeypatch):
    def failing(obj, f):
        f.write(b"\0" * 100)
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError:  # chained as torch.save's zip writer chains it: a context, no cause
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904

    monkeypatch.setattr(checkpoint.torch, "save", failing)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        atomic_save({}, tmp_path / "x.pth")
    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        atomic_save({}, tmp_path / "x.pth")
    assert not list(tmp_path.iterdir())


def test_other_write_errors_keep_their_traceback(tmp_path: Path, monkeypatch):
    def denied(obj, f):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint.torch, "save", denied)
    with pytest.raises(OSError, match="Input/output"):
        atomic_save({}, tmp_path / "x.pth")
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- resume checks


def saved_state(**config) -> dict:
    base = dict(TrainConfig().to_dict(), learning_rate=0.01, batch_size=8, epochs=2)
    return {"config": {**base, **config}, "rank_states": [{}, {}]}  # written by 2 processes


def test_changed_schedule_flags_are_listed(tmp_path: Path):
    state = saved_state()
    same = dict(state["config"], epochs=10)  # more epochs: allowed (a run may be extended)
    assert changed_settings(state, same, world_size=2) == []
    # momentum is sgd's, step_size/gamma the step schedule's: not reported for adamw + cosine.
    assert changed_settings(state, dict(same, momentum=0.5, gamma=0.5), 2) == []
    new = dict(same, learning_rate=0.1, scheduler="step", gamma=0.5, label_smoothing=0.1)
    assert changed_settings(state, new, 2) == [
        "--learning_rate 0.01 -> 0.1",
        "--scheduler cosine -> step",
        "--gamma 0.1 -> 0.5",
        "--label_smoothing 0.0 -> 0.1",
    ]
    # The batch of one optimizer step: 8 x 2 processes; 16 x 1 is the same batch.
    assert changed_settings(state, dict(same, batch_size=16), 1) == []
    assert changed_settings(state, same, 1) == [
        "effective batch per optimizer step (--batch_size x --accum_steps x processes) "
        "8x1x2=16 -> 8x1x1=8"
    ]
    path = tmp_path / "checkpoint_latest.pth"
    with pytest.raises(
        UserError,
        match=r"--learning_rate 0.01 -> 0.1; --scheduler cosine -> "
        r"step.*add --resume_override",
    ):
        check_resume_settings(state, path, new, 2, override=False)
    assert len(check_resume_settings(state, path, new, 2, override=True)) == 4


def test_override_applies_new_hyperparameters_and_keeps_moments():
    from functools import partial

    from imgtrainer.training.optim import lr_factor

    def build(lr: float, weight_decay: float, kind: str):
        model = torch.nn.Linear(4, 2)
        torch.manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
        factor = partial(
            lr_factor, kind=kind, warmup_steps=0, total_steps=10, decay_every=4, gamma=0.5
        )
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)

    model, opt, sched = build(0.1, 0.01, "cosine")
    for _ in range(5):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()

    _, new_opt, new_sched = build(0.5, 0.0, "step")
    from_flags = optimisation_settings(new_opt, new_sched)
    new_opt.load_state_dict(saved_opt)
    new_sched.load_state_dict(saved_sched)
    assert new_opt.param_groups[0]["initial_lr"] == 0.1  # the checkpoint's, so far
    apply_optimisation_settings(new_opt, new_sched, from_flags)
    group = new_opt.param_groups[0]
    # After 5 steps the step schedule (decay every 4) is at 0.5 x the new base of 0.5.
    assert (group["lr"], group["initial_lr"], group["weight_decay"]) == (0.25, 0.5, 0.0)
    assert new_sched.get_last_lr() == [0.25] and new_sched.last_epoch == 5
    for p in new_opt.param_groups[0]["params"]:  # momentum kept
        assert torch.equal(
            new_opt.state[p]["momentum_buffer"],
            saved_opt["state"][0 if p.dim() == 2 else 1]["momentum_buffer"],
        )
    new_opt.step()
    new_sched.step()
    assert new_opt.param_groups[0]["lr"] == 0.25  # step 6: still 0.5 x 0.5


# ----------------------------------------------------------------------------- end to end


def train_main(argv: list, capsys) -> tuple[int, str]:
    """train_ddp.main in this process: (exit code, stderr)."""
    from imgtrainer.run.train import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_second_run_resume_override_disk_full_and_overwrite_in_one_folder(
    tiny_dataset, tmp_path, capsys, monkeypatch
):
    train, val = tiny_dataset
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    flags = [
        *("--device", "cpu", *tiny_run_flags(train, val)),
        "--batch_size",
        "16",
        "--scheduler",
        "none",
        "--checkpoint_dir",
        ckpt,
        "--log_dir",
        logs,
        "--epochs",
        "1",
        *("--model", "test_resnet"),  # timm's small ResNet: 4 runs of cheap steps and saves
    ]
    assert train_main(flags, capsys)[0] == 0
    first = {
        p: p.read_bytes()
        for p in (
            ckpt / "checkpoint_latest.pth",
            ckpt / "checkpoint_best.pth",
            logs / "training_history.json",
        )
    }

    # A second run in the same folders: refused, nothing replaced.
    code, err = train_main(flags, capsys)
    assert code == 2 and err.count("error: ") == 1 and "Traceback" not in err
    assert "a new run would replace" in err and "--resume auto" in err and "--overwrite" in err
    # Resuming with another learning rate: refused, then applied with --resume_override.
    longer = [*flags, "--epochs", "2", "--learning_rate", "0.05", "--resume", "auto"]
    code, err = train_main(longer, capsys)
    assert code == 2 and "--learning_rate 0.01 -> 0.05" in err and "--resume_override" in err
    assert {p: p.read_bytes() for p in first} == first
    assert train_main([*longer, "--resume_override"], capsys)[0] == 0
    records = json.loads((logs / "training_history.json").read_text())["epochs"]
    assert [(r["epoch"], r["lr"]) for r in records] == [(1, 0.01), (2, 0.05)]
    group = torch.load(ckpt / "checkpoint_latest.pth", weights_only=True)["optimizer_state_dict"][
        "param_groups"
    ][0]
    assert (group["lr"], group["initial_lr"]) == (0.05, 0.05)

    # The disk fills at the next epoch's checkpoint: one line, the checkpoints and the history's
    # records intact (the resume itself rewrites the history's header with its own config).
    kept = {p: p.read_bytes() for p in ckpt.glob("checkpoint_*.pth")}
    monkeypatch.setattr(checkpoint.torch, "save", fail_after_writing(4096))
    code, err = train_main([*longer, "--epochs", "3"], capsys)
    monkeypatch.undo()
    assert code == 2 and err.count("error: ") == 1 and "Traceback" not in err, err
    assert f"no space left on the device to write {ckpt / 'checkpoint_latest.pth'}" in err
    assert {p: p.read_bytes() for p in kept} == kept and not list(ckpt.glob(".*.tmp"))
    assert json.loads((logs / "training_history.json").read_text())["epochs"] == records

    # --overwrite: a new 1-epoch run replaces the checkpoints and the history.
    assert train_main([*flags, "--overwrite", "--learning_rate", "0.02"], capsys)[0] == 0
    history_after = json.loads((logs / "training_history.json").read_text())
    assert history_after["config"]["learning_rate"] == 0.02
    assert [r["epoch"] for r in history_after["epochs"]] == [1]
    latest = torch.load(ckpt / "checkpoint_latest.pth", weights_only=True)
    assert latest["epoch"] == 1 and latest["config"]["learning_rate"] == 0.02
    assert not previous_path(ckpt / "checkpoint_latest.pth").exists()  # no fallback to the old run
    best = ckpt / "checkpoint_best.pth"
    assert (
        not best.exists() or torch.load(best, weights_only=True)["config"]["learning_rate"] == 0.02
    )


def test_a_locked_folder_is_one_line_naming_the_holder(tiny_dataset, tmp_path, capsys):
    train, val = tiny_dataset
    ckpt = tmp_path / "ckpt"
    flags = [
        *("--device", "cpu", *tiny_run_flags(train, val), "--epochs", "1"),
        *("--checkpoint_dir", ckpt, "--log_dir", tmp_path / "logs"),
    ]
    with FolderLock(ckpt):  # in this process, through another open file: still refused
        code, err = train_main(flags, capsys)
    assert code == 2 and err.count("error: ") == 1, err
    assert f"--checkpoint_dir {ckpt} is in use by another run (pid {os.getpid()} on host" in err
    code, err = train_main([*flags, "--checkpoint_dir", train / "cat" / "img_000.jpg"], capsys)
    assert code == 2 and "img_000.jpg is a file, not a folder" in err


@pytest.mark.slow
def test_a_locked_folder_stops_every_rank_with_the_same_line(tiny_dataset, tmp_path):
    """Two processes under torchrun, the folder locked by this test: rank 0 finds the lock, and
    rank 1, which looked at nothing, stops with the same line instead of waiting for rank 0."""
    train, val = tiny_dataset
    ckpt = tmp_path / "ckpt"
    with FolderLock(ckpt):
        result = run_cli(
            [
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                SRC / "train_ddp.py",
                *("--device", "cpu", *tiny_run_flags(train, val)),
                "--checkpoint_dir",
                ckpt,
            ],
            cwd=tmp_path,
            timeout=180,
        )
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and lines[0] == lines[1], result.stderr[-3000:]
    assert f"{ckpt} is in use by another run (pid {os.getpid()} on host" in lines[0]
    assert not (ckpt / "checkpoint_latest.pth").exists()

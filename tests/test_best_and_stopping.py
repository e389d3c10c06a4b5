"""--best_metric, early stopping, --val_every_epochs, the kept epochs' checkpoints and --max_time:
the rules on their own (a fake clock, tiny state dicts), then real runs in this process on
folders of 9 to 18 images (1 or 2 steps per epoch)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import imgtrainer.training.stopping as stopping
from conftest import CLASSES, ROOT, TINY_FLAGS, run_cli, run_train, write_image_folder
from imgtrainer.checkpoints.files import CheckpointError, load_checkpoint_file
from imgtrainer.checkpoints.run_folder import (
    check_new_run,
    epoch_checkpoint_name,
    epoch_checkpoints,
)
from imgtrainer.checkpoints.writer import CheckpointWriter
from imgtrainer.config import TrainConfig, parse_config, parse_duration
from imgtrainer.errors import UserError
from imgtrainer.hooks import StepInfo
from imgtrainer.training.best import BestTracker, metric_value
from imgtrainer.training.periodic import CheckpointAndStop, SaveSchedule
from imgtrainer.training.stopping import StopRequest, TimeBudget
from imgtrainer.training.trainer import Trainer


def record(epoch: int, **values: float) -> dict:
    return {"epoch": epoch, "train_loss": 1.0, **values}


# ----------------------------------------------------------------------------- the rules


def test_max_time_forms_and_bad_flags_are_one_clear_error():
    assert parse_duration("2h30m") == parse_duration("150m") == parse_duration("9000") == 9000
    assert parse_duration("45s") == 45 and parse_duration("1.5h") == 5400
    assert parse_duration("00:12:00:00") == parse_duration("12:00:00") == 43200
    for bad in ("", "soon", "0", "2h30", "1:30", "-5m"):
        with pytest.raises(UserError, match="--max_time"):
            parse_duration(bad)
    bad_combinations = {
        "--early_stopping_min_delta": ["--early_stopping_min_delta", "0.1"],
        "--model_ema": ["--best_metric", "val_acc_ema"],
        "--val_every_epochs": ["--val_every_epochs", "0"],
        "--keep_checkpoints": ["--keep_checkpoints", "-1"],
        "--max_time 'soon'": ["--max_time", "soon"],
    }
    for phrase, argv in bad_combinations.items():
        with pytest.raises(UserError, match=phrase):
            parse_config(argv)


def test_metric_value_takes_the_better_weights_and_the_right_direction():
    rec = record(1, val_acc=0.5, val_loss=0.9, val_acc_ema=0.6, val_loss_ema=1.1)
    assert metric_value(rec, "val_acc", ema_enabled=True) == (0.6, "ema")
    assert metric_value(rec, "val_loss", ema_enabled=True) == (0.9, "raw")  # lower is better
    assert metric_value(rec, "val_acc", ema_enabled=False) == (0.5, "raw")
    assert metric_value(rec, "val_loss_ema", ema_enabled=True) == (1.1, "ema")
    assert metric_value(record(2), "val_acc", ema_enabled=True) is None  # not validated


def test_patience_counts_validated_epochs_and_min_delta_only_for_stopping():
    cfg = TrainConfig(
        best_metric="val_loss", early_stopping_patience=2, early_stopping_min_delta=0.1
    )
    tracker = BestTracker(cfg)
    losses = {1: 1.0, 2: None, 3: 0.95, 4: None, 5: 0.97}  # None: not validated
    verdicts = []
    for epoch, loss in losses.items():
        rec = record(epoch) if loss is None else record(epoch, val_loss=loss)
        verdicts.append((tracker.update(rec), tracker.state.wait, tracker.should_stop))
    # Epoch 3 is the new best (any improvement) but not an improvement by more than 0.1.
    assert verdicts == [
        (True, 0, False),
        (False, 0, False),
        (True, 1, False),
        (False, 1, False),
        (False, 2, True),
    ]
    assert (tracker.state.value, tracker.state.epoch, tracker.state.reference) == (0.95, 3, 1.0)
    history = [record(e) if v is None else record(e, val_loss=v) for e, v in losses.items()]
    # The 2 best validated epochs, then every 4th epoch too.
    assert BestTracker(TrainConfig(best_metric="val_loss", keep_checkpoints=2)).kept_epochs(
        history
    ) == {3, 5}
    assert BestTracker(
        TrainConfig(best_metric="val_loss", keep_checkpoints=1, save_every_epochs=4)
    ).kept_epochs(history) == {3, 4}
    # Equal scores: the earlier epoch ranks first.
    ties = [record(1, val_acc=0.5), record(2, val_acc=0.5)]
    assert BestTracker(TrainConfig(keep_checkpoints=1)).kept_epochs(ties) == {1}


def test_resume_keeps_the_count_and_reads_older_checkpoints(tmp_path: Path):
    cfg = TrainConfig(best_metric="val_loss", early_stopping_patience=3)
    history = [record(1, val_loss=0.5, val_acc=0.7), record(2, val_loss=0.6, val_acc=0.8)]
    tracker = BestTracker(cfg)
    for rec in history:
        tracker.update(rec)
    saved = {"history": history, **tracker.checkpoint_fields(history)}
    assert saved["best_acc"] == 0.8  # its old meaning, for older readers
    resumed = BestTracker(cfg)
    resumed.resume(saved, tmp_path / "ckpt.pth", override=False)
    assert resumed.state == tracker.state and resumed.state.wait == 1
    # Before --best_metric: only best_acc; the best val_acc is replayed from the history.
    old = BestTracker(TrainConfig())
    old.resume({"history": history, "best_acc": 0.8}, tmp_path / "old.pth", override=False)
    assert (old.state.metric, old.state.value, old.state.epoch) == ("val_acc", 0.8, 2)
    # Another metric changes what checkpoint_best.pth means: refused, or replayed under
    # --resume_override.
    with pytest.raises(CheckpointError, match="--best_metric val_loss, not val_acc"):
        BestTracker(TrainConfig()).resume(saved, tmp_path / "ckpt.pth", override=False)
    other = BestTracker(TrainConfig(resume="auto", resume_override=True))
    other.resume(saved, tmp_path / "ckpt.pth", override=True)
    assert (other.state.value, other.state.epoch) == (0.8, 2)


def test_time_budget_keeps_room_for_the_next_step_and_a_checkpoint():
    now = [0.0]
    budget = TimeBudget(100.0, clock=lambda: now[0])
    budget.start_steps()
    for duration in (2.0, 5.0, 3.0):  # the estimate is the longest recent step
        now[0] += duration
        budget.step_done()
    assert budget.step_estimate() == 5.0
    assert budget.validation_estimate(batches=4) == 20.0  # before one was timed
    budget.timed_validation(7.0)
    budget.timed_save(1.0)
    now[0] = 92.0  # 8 s left: a step and a save (x1.25 = 7.5 s) fit, a validation does not
    assert not budget.too_short_for(budget.step_estimate())
    assert budget.too_short_for(budget.validation_estimate(batches=4))
    assert not TimeBudget(None).too_short_for(1e9)
    # The next point to stop at: the next step, or at an epoch's end its validation if any.
    assert not budget.too_short_for_next_stop(at_epoch_end=False, validation_batches=None)
    assert budget.too_short_for_next_stop(at_epoch_end=True, validation_batches=4)
    assert not budget.too_short_for_next_stop(at_epoch_end=True, validation_batches=None)


def test_time_stop_exits_0_and_a_signal_wins():
    stop = StopRequest(distributed=False)
    assert not stop.agreed() and stop.exit_code == 143
    assert stop.agreed(time_up=True) and stop.by_time and stop.exit_code == 0
    stop.signum = signal.SIGINT
    assert stop.agreed() and not stop.by_time and stop.exit_code == 130


def test_save_schedule_counts_steps_and_the_minutes_since_the_last_checkpoint():
    now = [100.0]
    schedule = SaveSchedule(steps=3, seconds=600.0, clock=lambda: now[0])
    assert [schedule.by_count(step) for step in (1, 3, 4, 6)] == [False, True, False, True]
    now[0] = 699.0
    assert not schedule.due()
    now[0] = 700.0  # ten minutes since it was made
    assert schedule.due()
    schedule.saved()  # any checkpoint: the ten minutes start again
    assert not schedule.due()
    now[0] = 1300.0
    assert schedule.due()
    off = SaveSchedule(steps=0, seconds=0.0, clock=lambda: now[0])
    now[0] = 1e9
    assert not off.by_count(3) and not off.due()


def saves_of_an_epoch(
    monkeypatch, steps: int, distributed: bool, clock_at: dict[int, float], other_due=()
) -> list[int]:
    """The steps of one epoch of ``steps`` steps after which ``CheckpointAndStop`` saves, with
    --save_every_minutes 10 and this rank's clock at ``clock_at[step]`` from that step on;
    with ``distributed``, the agreement gathers this rank's row and another rank's (its save
    due at the steps ``other_due``)."""
    now = [0.0]
    schedule = SaveSchedule(steps=0, seconds=600.0, clock=lambda: now[0])
    stop = StopRequest(distributed=False)
    if distributed:  # the gather faked: no process group needed for the rule
        stop.distributed = True
        gathered = []

        def gather(row, group):
            gathered.append(step)
            other = torch.tensor([0.0, step in other_due], dtype=torch.float64)
            return torch.stack([row, other])

        monkeypatch.setattr(stopping, "all_gather_rows", gather)
    saved = []

    def save(sums):
        saved.append(step)
        schedule.saved()  # as Trainer.save_checkpoint does after every checkpoint

    hook = CheckpointAndStop(stop, lambda *_: False, save, steps, schedule)
    for step in range(1, steps + 1):
        now[0] = clock_at.get(step, now[0])
        assert not hook.on_step_end(StepInfo(step, step, torch.zeros(3)))
    if distributed:  # the ranks met at every 10th step and after the last, no more
        assert gathered == [*range(10, steps, 10), steps]
    return saved


def test_a_checkpoint_due_by_time_waits_for_the_ranks_next_agreement(monkeypatch):
    # One process agrees with itself after every step: saved at the first step past 10 min,
    # then 10 min after that save.
    clock = {4: 599.0, 5: 600.0, 9: 1199.0, 12: 1200.0}
    assert saves_of_an_epoch(monkeypatch, 30, False, clock) == [5, 12]
    # Several: due at step 5 on this rank's clock, saved at the agreement of step 10, and not
    # again at 20 (the clock started again at 10); due at 23, but step 25 ends the epoch, whose
    # own checkpoint comes next.
    assert saves_of_an_epoch(monkeypatch, 25, True, {5: 600.0, 20: 1199.0, 23: 1300.0}) == [10]
    # Another rank's clock says it is due: every rank saves, at the same step.
    assert saves_of_an_epoch(monkeypatch, 25, True, {}, other_due={20}) == [20]


def _agreement_worker(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {}
        # Only rank 1's budget ran out: both stop, both with the budget's exit code 0.
        stop = StopRequest(distributed=True)
        results["time"] = (stop.agreed(time_up=rank == 1), stop.exit_code)
        # Rank 0 was signalled while rank 1's budget ran out: the signal's code everywhere.
        stop = StopRequest(distributed=True)
        stop.signum = signal.SIGTERM if rank == 0 else None
        results["signal"] = (stop.agreed(time_up=rank == 1), stop.exit_code)
        # A checkpoint due by time on rank 1's clock only: both save, neither stops; then not.
        stop = StopRequest(distributed=True)
        results["save"] = [(stop.agreed(save_due=due), stop.save_agreed) for due in (rank, 0)]
        # The ranks' metrics differ (they never should): the main process's verdict holds.
        best = BestTracker(TrainConfig(early_stopping_patience=1))
        best.agree(record(1, val_acc=0.5), distributed=True)
        is_best = best.agree(record(2, val_acc=0.4 if rank == 0 else 0.9), distributed=True)
        results["best"] = (is_best, best.state.epoch, best.should_stop)
        (out / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_every_rank_agrees_on_a_time_stop_and_on_early_stopping(tmp_path: Path):
    from imgtrainer.run.launcher import free_port

    # Forked: no second import of torch.
    ranks = mp.start_processes(
        _agreement_worker, args=(free_port(), tmp_path), nprocs=2, join=False, start_method="fork"
    )
    deadline = time.monotonic() + 60
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two ranks did not finish")
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results == {
            "time": [True, 0],
            "signal": [True, 143],
            "save": [[False, True], [False, False]],
            "best": [False, 1, True],
        }, rank


def test_kept_epochs_are_links_of_the_latest_and_go_only_after_the_new_one(tmp_path: Path):
    writer = CheckpointWriter(tmp_path, enabled=True)
    for epoch, kept in ((1, {1}), (2, {1, 2}), (3, {2, 3})):
        writer.save({"epoch": epoch, "w": torch.ones(2) * epoch}, is_best=False, keep_epochs=kept)
    assert list(epoch_checkpoints(tmp_path)) == [2, 3]
    third = tmp_path / epoch_checkpoint_name(3)
    assert os.path.samefile(third, writer.latest)  # a second name, not a copy
    assert load_checkpoint_file(tmp_path / epoch_checkpoint_name(2))["epoch"] == 2
    # Resumed from epoch 1: epoch 3's file (of the run that went further) waits for epoch 3.
    writer.save({"epoch": 2, "w": torch.zeros(2)}, is_best=False, keep_epochs={1})
    assert list(epoch_checkpoints(tmp_path)) == [3]
    # Mid-epoch saves keep nothing and remove nothing.
    writer.save({"epoch": 2, "w": torch.zeros(2)}, is_best=False)
    assert list(epoch_checkpoints(tmp_path)) == [3]
    # A new run refuses a folder holding kept epochs only; --overwrite removes them at its
    # first save.
    writer.latest.unlink()
    for path in tmp_path.glob("checkpoint_latest*.pth"):
        path.unlink()
    for resume in (None, "auto"):
        with pytest.raises(UserError, match="checkpoint_epoch_003.pth"):
            check_new_run(tmp_path, tmp_path / "logs", resume, overwrite=False)
    CheckpointWriter(tmp_path, enabled=True, replace_previous_run=True).save(
        {"epoch": 0}, is_best=False
    )
    assert epoch_checkpoints(tmp_path) == {}


# ----------------------------------------------------------------------------- real runs


def small_folders(root: Path, per_class: int) -> list[str]:
    """The flags of a run on ``per_class`` train images per class (steps of 8, the last
    incomplete one dropped) and 2 val images per class."""
    train = write_image_folder(root / "data" / "train", CLASSES, per_class, seed=1)
    val = write_image_folder(root / "data" / "val", CLASSES, 2, seed=2)
    return ["--train_dir", train, "--val_dir", val, *TINY_FLAGS, "--no_tensorboard"]


def history_of(root: Path) -> list[dict]:
    return json.loads((root / "logs" / "training_history.json").read_text())["epochs"]


def test_early_stopping_keeps_checkpoints_and_its_count_across_a_resume(tmp_path: Path, capsys):
    # No val_loss improves by 10: the second validation ends the run.
    flags = [
        *small_folders(tmp_path, per_class=3),  # 1 step per epoch
        *("--epochs", "8", "--best_metric", "val_loss", "--early_stopping_min_delta", "10"),
        *("--keep_checkpoints", "1", "--save_every_epochs", "3"),
    ]
    assert run_train([*flags, "--early_stopping_patience", "1"], cwd=tmp_path) == 0
    records = history_of(tmp_path)
    best_epoch = min((1, 2), key=lambda e: (records[e - 1]["val_loss"], e))
    assert (
        f"Stopped early after epoch 2 of 8: val_loss did not improve by more than 10 in 1 "
        f"validated epochs (--early_stopping_patience 1); best val_loss "
        f"{records[best_epoch - 1]['val_loss']:.4f} (epoch {best_epoch})"
    ) in capsys.readouterr().out
    report = (tmp_path / "logs" / "report.html").read_text()
    assert "Stopped early after epoch 2 of 8" in report and "best val_loss" in report
    assert f"the best checkpoint (epoch {best_epoch}, its trained weights)" in report
    checkpoints = tmp_path / "checkpoints"
    assert list(epoch_checkpoints(checkpoints)) == [best_epoch]
    best = load_checkpoint_file(checkpoints / "checkpoint_best.pth")
    assert (best["epoch"], best["best_epoch"], best["best_metric"]) == (
        best_epoch,
        best_epoch,
        "val_loss",
    )
    # Resumed as it is, the run is over: no epoch is trained again.
    assert run_train([*flags, "--early_stopping_patience", "1", "--resume", "auto"], tmp_path) == 0
    assert "Stopped early after epoch 2 of 8" in capsys.readouterr().out
    assert len(history_of(tmp_path)) == 2
    # More patience continues with the saved count (1): one more validation without an
    # improvement ends it, not two.
    assert run_train([*flags, "--early_stopping_patience", "2", "--resume", "auto"], tmp_path) == 0
    assert "Stopped early after epoch 3 of 8" in capsys.readouterr().out
    # Its events: three starts, each ended by early stopping, a finished run; resumed by the user.
    events = json.loads((tmp_path / "logs" / "training_history.json").read_text())["events"]
    ends = [(e["reason"], e["finished"], e["epoch"]) for e in events if e["kind"] == "stop"]
    assert ends == [("early_stopping", True, 2)] * 2 + [("early_stopping", True, 3)]
    assert [e["by"] for e in events if e["kind"] == "resume"] == ["user", "user"]
    records = history_of(tmp_path)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    best_epoch = min((1, 2, 3), key=lambda e: (records[e - 1]["val_loss"], e))
    assert sorted(epoch_checkpoints(checkpoints)) == sorted({best_epoch, 3})
    assert load_checkpoint_file(checkpoints / epoch_checkpoint_name(3))["epoch"] == 3


@pytest.mark.slow  # two training runs, in this process
def test_checkpoints_due_by_time_change_when_files_are_written_not_the_weights(
    tmp_path: Path, monkeypatch
):
    """Two runs of an epoch of 4 steps: --save_every_minutes 0, and so short a time that a
    checkpoint is due after every step. That one is written after each step inside the epoch
    (its last step waits for the epoch's own), every checkpoint starts the clock again, and
    both runs end with the same weights and optimizer state, bit for bit."""
    flags = [*small_folders(tmp_path, per_class=12), "--epochs", "1", "--model", "test_resnet"]
    written, restarted = [], []
    write, saved = CheckpointWriter.save_with_history, SaveSchedule.saved

    def counted_write(writer, state, *args, **kwargs):
        written.append((state["epoch"], state["step"]))
        return write(writer, state, *args, **kwargs)

    def counted_saved(schedule):
        restarted.append(len(written))
        saved(schedule)

    monkeypatch.setattr(CheckpointWriter, "save_with_history", counted_write)
    monkeypatch.setattr(SaveSchedule, "saved", counted_saved)
    ends = {}
    for name, minutes in (("off", "0"), ("due", "1e-6")):
        written.clear(), restarted.clear()
        (tmp_path / name).mkdir()
        assert run_train([*flags, "--save_every_minutes", minutes], cwd=tmp_path / name) == 0
        assert restarted == list(range(1, len(written) + 1))  # after each checkpoint
        latest = tmp_path / name / "checkpoints" / "checkpoint_latest.pth"
        ends[name] = (list(written), load_checkpoint_file(latest))
    assert ends["off"][0] == [(1, 0)]
    assert ends["due"][0] == [(0, 1), (0, 2), (0, 3), (1, 0)]
    off, due = ends["off"][1], ends["due"][1]
    weights = off["model_state_dict"]
    assert weights.keys() == due["model_state_dict"].keys()
    assert all(torch.equal(weights[k], due["model_state_dict"][k]) for k in weights)
    moments = off["optimizer_state_dict"]["state"]
    assert moments.keys() == due["optimizer_state_dict"]["state"].keys() and moments
    for index, state in moments.items():
        for name, value in state.items():
            other = due["optimizer_state_dict"]["state"][index][name]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (index, name)


def test_max_time_stops_with_a_checkpoint_and_exit_0_then_resumes(
    tmp_path: Path, capsys, monkeypatch
):
    flags = [
        *small_folders(tmp_path, per_class=6),  # 2 steps per epoch
        *("--epochs", "2", "--save_every_epochs", "1", "--val_every_epochs", "2"),
    ]
    # A budget smaller than a checkpoint's first estimate: one step, its checkpoint, the end.
    assert run_train([*flags, "--max_time", "1s"], cwd=tmp_path) == 0
    out = capsys.readouterr().out
    assert "Stopped at epoch 1, step 1 (the --max_time budget 1s is nearly spent)" in out
    assert "--resume checkpoints/checkpoint_latest.pth" in out
    # Its report too, before any validation: no predictions yet, and it says why.
    report = (tmp_path / "logs" / "report.html").read_text()
    assert "Stopped at epoch 1, step 1 (the --max_time budget 1s is nearly spent)" in report
    assert "No validation predictions yet" in report
    assert load_checkpoint_file(tmp_path / "checkpoints" / "checkpoint_latest.pth")["step"] == 1
    # Out of time after an epoch's last step: saved there, the epoch finished on resume.
    monkeypatch.setattr(
        Trainer,
        "time_runs_out",
        lambda trainer, at_epoch_end, *_: at_epoch_end and trainer.epoch == 0,
    )
    assert run_train([*flags, "--max_time", "1h", "--resume", "auto"], cwd=tmp_path) == 0
    assert "Stopped at epoch 1, step 2 (the --max_time budget 1h" in capsys.readouterr().out
    monkeypatch.undo()
    assert run_train([*flags, "--resume", "auto"], cwd=tmp_path) == 0
    assert "Done: best val_acc" in capsys.readouterr().out
    # The three starts' events, the stopped ones' too; the last ends done.
    events = json.loads((tmp_path / "logs" / "training_history.json").read_text())["events"]
    ends = [(e["kind"], e.get("reason"), e["finished"]) for e in events if "finished" in e]
    assert ends == [("stop", "max_time", False)] * 2 + [("done", None, True)]
    resumes = [
        (e["epoch"], e["step"], e["world_size_before"]) for e in events if e["kind"] == "resume"
    ]
    assert resumes == [(1, 1, 1), (1, 2, 1)]  # where each stop saved
    # Only the last epoch is validated (--val_every_epochs 2): the first has no val_* keys.
    assert [("val_acc" in r) for r in history_of(tmp_path)] == [False, True]
    assert [r["epoch"] for r in history_of(tmp_path)] == [1, 2]
    assert sorted(epoch_checkpoints(tmp_path / "checkpoints")) == [1, 2]


@pytest.mark.slow
def test_time_budget_validation_interval_and_balancing_through_the_launcher(
    tiny_dataset, tmp_path: Path
):
    """Through the real launcher: --max_time stops after the first step with a checkpoint, exit
    code 0 and the resume command; the resumed run (balanced loss and sampler, validating every
    2nd epoch and the last) finishes with each epoch once and val metrics where validated."""
    train, val = tiny_dataset
    flags = [
        ROOT / "launch_ddp.py",
        *("--device", "cpu", "--nproc", "1", "--train_dir", train, "--val_dir", val),
        *("--epochs", "3", "--val_every_epochs", "2"),
        *("--class_weights", "balanced", "--sampler", "balanced"),
        *TINY_FLAGS,
        *("--model", "test_resnet"),  # timm's small ResNet: 3 epochs of cheap steps and saves
    ]
    stopped = run_cli([*flags, "--max_time", "1s"], cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "--resume" in stopped.stdout + stopped.stderr
    latest = tmp_path / "checkpoints" / "checkpoint_latest.pth"
    first = torch.load(latest, weights_only=True)
    assert (first["epoch"], first["step"]) == (0, 1)
    resumed = run_cli([*flags, "--resume", "auto"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    last = torch.load(latest, weights_only=True)
    assert last["epoch"] == 3 and last["config"]["sampler"] == "balanced"
    assert last["config"]["class_weights"] == "balanced"
    records = last["history"]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert ["val_acc" in r for r in records] == [False, True, True]
    assert last["best_epoch"] in (2, 3)

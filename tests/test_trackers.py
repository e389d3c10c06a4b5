"""metrics.csv beside the history, and the --log_to trackers (W&B, MLflow) through fake packages
injected into sys.modules: the calls each adapter makes, and one line when a package is missing
or refuses to start."""

from __future__ import annotations

import csv
import json
import sys
import types
from pathlib import Path

import pytest

from imgtrainer.config import TrainConfig, parse_config, tracker_names
from imgtrainer.errors import UserError
from imgtrainer.reports.history import HistoryWriter
from imgtrainer.reports.trackers import TrackerContext, build_trackers


def test_metrics_csv_follows_the_history_and_drops_rows_on_resume(tmp_path: Path):
    writer = HistoryWriter(tmp_path / "training_history.json", {"config": {}}, enabled=True)
    writer.save()
    assert (tmp_path / "metrics.csv").read_text() == ""
    for epoch in (1, 2, 3):
        writer.append({"epoch": epoch, "train_loss": 1 / epoch, "val_acc": 0.25 * epoch})
    writer.records[2]["val_acc_ema"] = 0.8  # a column that appears later
    writer.save()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [float(r["train_loss"]) for r in rows] == [1.0, 0.5, 1 / 3]  # exact floats
    assert [r["val_acc_ema"] for r in rows] == ["", "", "0.8"]
    writer.records = writer.records[:2]  # what a resume from epoch 2's checkpoint does
    writer.save()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2"] and "val_acc_ema" not in rows[0]
    disabled = HistoryWriter(tmp_path / "sub" / "h.json", {}, enabled=False)
    disabled.append({"epoch": 1})
    disabled.save()
    assert not (tmp_path / "sub").exists()


def test_the_shared_runs_metrics_csv_matches_its_history(trained_run):
    logs = trained_run.root / "logs"
    records = json.loads((logs / "training_history.json").read_text())["epochs"]
    rows = list(csv.DictReader((logs / "metrics.csv").open()))
    assert len(rows) == len(records) == 2
    for row, record in zip(rows, records, strict=True):
        assert row.keys() == record.keys()
        assert all(float(row[key]) == float(value) for key, value in record.items())


def test_log_to_names_are_checked():
    assert tracker_names("none") == tracker_names("") == []
    assert tracker_names("wandb, mlflow") == ["wandb", "mlflow"]
    with pytest.raises(UserError, match="unknown tracker 'comet'; choose from wandb, mlflow"):
        parse_config(["--log_to", "wandb,comet"])
    with pytest.raises(UserError, match="twice"):
        tracker_names("wandb,wandb")


# ----------------------------------------------------------------------------- fake packages


class Calls(list):
    def named(self, name: str) -> list:
        return [args for call, *args in self if call == name]


def fake_wandb(calls: Calls, fail: Exception | None = None) -> types.ModuleType:
    module = types.ModuleType("wandb")
    run = types.SimpleNamespace(
        id="wb123",
        log=lambda values, step: calls.append(("log", values, step)),
        finish=lambda: calls.append(("finish",)),
        summary=types.SimpleNamespace(update=lambda values: calls.append(("summary", values))),
    )

    def init(**kwargs):
        calls.append(("init", kwargs))
        if fail is not None:
            raise fail
        return run

    module.init = init
    return module


def fake_mlflow(calls: Calls) -> types.ModuleType:
    module = types.ModuleType("mlflow")

    def start_run(run_id=None):
        calls.append(("start_run", run_id))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id or "ml456"))

    module.start_run = start_run
    module.log_params = lambda params: calls.append(("log_params", params))
    module.log_metrics = lambda values, step: calls.append(("log_metrics", values, step))
    module.end_run = lambda: calls.append(("end_run",))
    module.get_tracking_uri = lambda: "file:///tmp/mlruns"
    return module


def test_a_run_logged_to_a_file_with_trackers(tiny_dataset, tmp_path: Path, monkeypatch):
    """``train_ddp.py --log_to wandb,mlflow > train.log 2>&1`` (in this process, its stdout and
    stderr a file): plain lines, one per --log_interval steps and one per epoch, no carriage
    return; metrics.csv holds the history's records; the trackers get the same curves and keep
    their run on resume."""
    from conftest import TINY_FLAGS, run_train

    wandb_calls, mlflow_calls = Calls(), Calls()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wandb_calls))
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mlflow_calls))
    train, val = tiny_dataset
    flags = ["--train_dir", train, "--val_dir", val, *TINY_FLAGS, "--model", "test_resnet"]
    flags += ["--no_tensorboard", "--log_interval", "3", "--epochs", "1"]
    log_file = tmp_path / "train.log"
    with open(log_file, "w") as out, monkeypatch.context() as console:
        console.setattr(sys, "stdout", out)
        console.setattr(sys, "stderr", out)
        code = run_train([*flags, "--log_to", "wandb,mlflow"], tmp_path)
    text = log_file.read_text()
    assert code == 0, text
    assert "\r" not in text
    lines = text.splitlines()
    # 48 images in batches of 8: 6 steps, a line at steps 3 and 6, then the epoch's line
    steps = [line.split("  ")[0] for line in lines if " step " in line and "img/s" in line]
    assert steps == ["epoch 1/1 step 3/6", "epoch 1/1 step 6/6"]
    assert len([line for line in lines if line.startswith("epoch ") and "val_acc" in line]) == 1
    records = json.loads((tmp_path / "logs" / "training_history.json").read_text())["epochs"]
    with open(tmp_path / "logs" / "metrics.csv", newline="") as table:
        rows = list(csv.DictReader(table))
    assert len(rows) == len(records) == 1
    assert {key: float(value) for key, value in rows[0].items()} == records[0]

    (init,) = wandb_calls.named("init")
    assert init[0]["config"]["log_to"] == "wandb,mlflow" and init[0]["id"] is None
    logged = wandb_calls.named("log")
    assert [step for _, step in logged] == [3, 6, 6]  # 6 steps: two logging steps, one epoch
    assert set(logged[0][0]) == {
        "train/train_loss",
        "train/train_acc",
        "train/lr",
        "train/images_per_sec",
        "train/data_wait_share",
    }
    assert logged[2][0]["epoch/epoch"] == 1.0 and "epoch/val_acc" in logged[2][0]
    assert wandb_calls.named("summary")[0][0]["epoch"] == 1.0
    assert wandb_calls[-1] == ("finish",)

    assert mlflow_calls.named("start_run") == [[None]]
    (params,) = mlflow_calls.named("log_params")
    assert params[0]["learning_rate"] == "0.01"
    assert [step for _, step in mlflow_calls.named("log_metrics")] == [3, 6, 6]
    assert mlflow_calls[-1] == ("end_run",)
    ids = json.loads((tmp_path / "logs" / "tracker_runs.json").read_text())
    assert ids == {"wandb": "wb123", "mlflow": "ml456"}

    # A resumed run continues the same tracked runs (parameters are written once).
    resumed = TrackerContext(TrainConfig(log_to="wandb,mlflow"), tmp_path / "logs", 6, 6)
    wandb_calls.clear(), mlflow_calls.clear()
    build_trackers("wandb,mlflow", resumed)
    assert wandb_calls.named("init")[0][0]["id"] == "wb123"
    assert wandb_calls.named("init")[0][0]["resume"] == "allow"
    assert mlflow_calls == [("start_run", "ml456")]


def test_a_missing_package_or_login_is_one_line(tmp_path: Path, monkeypatch):
    context = TrackerContext(TrainConfig(), tmp_path, 0, 6)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an uninstalled package does
    with pytest.raises(UserError) as err:
        build_trackers("mlflow", context)
    assert "--log_to mlflow needs the mlflow package" in str(err.value)
    assert "pip install mlflow" in str(err.value)
    refused = RuntimeError("api_key not configured (no-tty). call wandb.login(key=...)\nmore")
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(Calls(), fail=refused))
    with pytest.raises(UserError) as err:
        build_trackers("wandb", context)
    line = str(err.value)
    assert "api_key not configured" in line and "WANDB_MODE=offline" in line
    assert "wandb login" in line and "\n" not in line
    assert not (tmp_path / "tracker_runs.json").exists()


def test_a_tracker_failing_mid_run_is_switched_off(tmp_path: Path, monkeypatch, caplog):
    calls = Calls()
    module = fake_mlflow(calls)

    def down(values, step):
        raise ConnectionError("server gone")

    module.log_metrics = down
    monkeypatch.setitem(sys.modules, "mlflow", module)
    (tracker,) = build_trackers("mlflow", TrackerContext(TrainConfig(), tmp_path, 0, 6))
    tracker.on_log_step(1, {"train_loss": 1.0})
    tracker.on_epoch_end(1, {"epoch": 1})
    assert not tracker.enabled
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        "--log_to mlflow failed (ConnectionError: server gone); it is off from now on"
    ]


def test_an_epoch_record_keeps_the_historys_key_order_and_its_log_line():
    from imgtrainer.reports.history import EpochRecord

    val = {"val_loss": 0.5, "val_acc": 0.75, "val_top5": 1.0}
    val |= {"val_loss_ema": 0.25, "val_acc_ema": 0.875, "val_top5_ema": 1.0}
    record = EpochRecord(3, 0.125, 0.5, val, 1e-3, 12.34, 456.7, 89.0, 8)
    assert list(record.as_dict()) == [
        *("epoch", "train_loss", "train_acc", *val),
        *("lr", "epoch_seconds", "train_images_per_sec", "peak_memory_mb", "micro_batch"),
    ]
    assert record.line(10) == (
        "epoch 3/10  train_loss 0.1250  train_acc 0.5000  val_loss 0.5000  val_acc 0.7500  "
        "val_top5 1.0000  val_loss_ema 0.2500  val_acc_ema 0.8750  val_top5_ema 1.0000  "
        "lr 1.00e-03  457 img/s  12.3s"
    )
    unvalidated = EpochRecord(1, 0.125, 0.5, {}, 1e-3, 1.0, 2.0, 3.0, 8)
    assert "(not validated)  lr" in unvalidated.line(10)
    assert "val_loss" not in unvalidated.as_dict()
    writer = HistoryWriter(Path("unused.json"), {}, enabled=False)
    assert writer.append(record) == record.as_dict() == writer.records[0]


def test_the_best_epoch_reads_the_same_in_every_line():
    from imgtrainer.reports.history import best_line, best_note
    from imgtrainer.training.best import BestState

    best = BestState("val_acc", value=0.91234, epoch=7, weights="ema")
    assert best_line(best) == "best val_acc 0.9123 (epoch 7)"
    assert best_line(best, ema_enabled=True) == "best val_acc 0.9123 (EMA weights, epoch 7)"
    assert best_note(best, ema_enabled=False) == "  (best)"
    assert best_note(best, ema_enabled=True) == "  (best: EMA weights)"
    assert best_note(BestState("val_loss", weights="raw"), True) == "  (best val_loss: raw weights)"
    assert best_line(BestState("val_loss")) == "no best val_loss yet"


def test_tensorboard_is_built_by_its_flag_before_the_log_to_trackers(tmp_path: Path):
    from imgtrainer.reports.trackers.tensorboard_tracker import Tracker as TensorBoard

    context = TrackerContext(TrainConfig(), tmp_path, 0, 6)
    assert build_trackers("none", context) == []
    (tracker,) = build_trackers("none", context, tensorboard=True)
    assert isinstance(tracker, TensorBoard) and tracker.enabled
    tracker.on_epoch_end(1, {"epoch": 1, "val_acc": 0.5})
    tracker.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

"""metrics.csv beside the history, and the --log_to trackers with the real W&B and MLflow
packages, offline, read back through their own readers; one line when a package is missing or a
tracker refuses to start."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY_FLAGS, user_error_line
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


# ----------------------------------------------------------------------------- the real packages
# W&B and MLflow themselves (requirements-trackers.txt), offline: W&B's offline mode and MLflow's
# SQLite store in the run's log folder; what they logged is read back through their own APIs.

TRACKER_PACKAGES = ("wandb", "mlflow", "sqlalchemy")
MISSING = [name for name in TRACKER_PACKAGES if importlib.util.find_spec(name) is None]
needs_trackers = pytest.mark.skipif(
    bool(MISSING), reason=f"not installed: {MISSING} (pip install -r requirements-trackers.txt)"
)


def offline_env(home: Path) -> dict[str, str]:
    """This environment without the user's W&B and MLflow settings, offline (MLflow's usage
    telemetry off too), with every per-user folder (home, caches, temporary files) in ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    for name, sub in [("HOME", ""), ("XDG_CACHE_HOME", ".cache"), ("XDG_CONFIG_HOME", ".config")]:
        env[name] = str(home / sub)
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env | {
        "TMPDIR": str(home / "tmp"),
        "WANDB_MODE": "offline",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PYTHONUNBUFFERED": "1",
    }


def network_traced(command: list[str], log: Path) -> list[str]:
    """``command`` under strace, recording every connect() into ``log``; as it is where strace
    is missing or may not trace."""
    trace = ["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=connect", "-e", "signal=none"]
    if shutil.which("strace") is None or subprocess.call([*trace, "-o", os.devnull, "true"]):
        return command
    return [*trace, "-o", str(log), *command]


def network_connections(log: Path) -> list[str]:
    """The connect() calls of a traced run to a network address (not this machine's)."""
    if not log.exists():
        return []
    return [
        line
        for line in log.read_text().splitlines()
        if re.search(r"sa_family=AF_INET6?\b", line)
        and not re.search(r'inet_addr\("127\.|inet_pton\(AF_INET6, "::1"', line)
    ]


def wandb_records(run_dir: Path, env: dict[str, str]) -> list[dict]:
    """The records of an offline W&B run's .wandb log, as W&B's own reader prints them."""
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def step_lines(text: str, steps_per_epoch: int) -> dict[int, dict[str, float]]:
    """The console's logging-step lines by global step: loss, acc and lr as printed."""
    found = {}
    pattern = r"epoch (\d+)/\d+ step (\d+)/\d+  loss (\S+)  acc (\S+)  lr (\S+)"
    for epoch, step, loss, acc, lr in re.findall(pattern, text):
        global_step = (int(epoch) - 1) * steps_per_epoch + int(step)
        found[global_step] = {"train_loss": float(loss), "train_acc": float(acc), "lr": float(lr)}
    return found


@needs_trackers
@pytest.mark.slow
def test_a_run_tracked_by_wandb_and_mlflow_offline_reads_back_as_its_history(
    tiny_dataset, tmp_path
):
    """``train_ddp.py --log_to wandb,mlflow > train.log 2>&1``, 1 epoch then resumed to 2, with
    the real packages: each tracker holds the history's epoch records, the same logging steps as
    the console, the run's configuration, and one tracked run across the resume; nothing reaches
    the network, and nothing lands outside the run's folders but W&B's own service logs."""
    train, val = tiny_dataset
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    env = offline_env(home)
    flags = ["--device", "cpu", "--train_dir", train, "--val_dir", val, *TINY_FLAGS]
    flags += ["--model", "test_resnet", "--no_tensorboard", "--log_interval", "3"]
    flags += ["--log_to", "wandb,mlflow"]
    logs, texts, configs = work / "logs", [], []
    for more in (["--epochs", "1"], ["--epochs", "2", "--resume", "auto"]):
        command = [sys.executable, str(ROOT / "src" / "train_ddp.py"), *map(str, flags + more)]
        with open(tmp_path / "train.log", "w") as out:
            code = subprocess.call(
                network_traced(command, tmp_path / "connect.trace"),
                cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=180,
            )  # fmt: skip
        texts.append((tmp_path / "train.log").read_text())
        assert code == 0, texts[-1]
        assert "\r" not in texts[-1]
        assert len(re.findall(r"^epoch \d/\d  train_loss", texts[-1], re.MULTILINE)) == 1
        assert re.search(
            r"--log_to wandb: W&B run \w+, offline in logs/wandb/offline-run-", texts[-1]
        )
        assert network_connections(tmp_path / "connect.trace") == []
        configs.append(json.loads((logs / "training_history.json").read_text())["config"])
    # Every file in the run's folders, but W&B's service logs in its cache folder (before W&B's
    # reader below writes its own log there).
    assert sorted(p.name for p in work.iterdir()) == ["checkpoints", "logs"]
    outside = sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())
    wandb_logs = r"\.cache/wandb/logs/(core|symon)-debug-[0-9_]+\.log"
    assert [p for p in outside if not re.fullmatch(wandb_logs, p)] == []
    history = json.loads((logs / "training_history.json").read_text())["epochs"]
    ids = json.loads((logs / "tracker_runs.json").read_text())
    steps = step_lines("".join(texts), steps_per_epoch=6)  # 48 images, batches of 8
    assert sorted(steps) == [3, 6, 9, 12]

    # MLflow: one run in the log folder's store, continued by the resume.
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{logs / 'mlflow.db'}")
    (run,) = client.search_runs(["0"])
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in configs[0].items()}  # written once

    def mlflow_series(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    # W&B: one offline run folder per process, both of the same run.
    run_dirs = sorted((logs / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2
    wandb_rows: dict[int, dict] = {}
    for run_dir, config in zip(run_dirs, configs, strict=True):
        records = wandb_records(run_dir, env)
        (started,) = [r["run"] for r in records if r["type"] == "run"]
        assert started["run_id"] == ids["wandb"] and started["project"] == "imgtrainer"
        logged = {k: v for k, v in started["config"]["update"].items() if k != "_wandb"}
        assert logged == json.loads(json.dumps(config))
        for row in (r["history"] for r in records if r["type"] == "history"):
            wandb_rows[row["step"]["num"]] = row["item"]
    assert sorted(wandb_rows) == [3, 6, 9, 12]

    # The epoch records, exactly, at the global step where each epoch ended.
    for record in history:
        step = record["epoch"] * 6
        for key, value in record.items():
            assert mlflow_series(f"epoch/{key}")[step] == value, key
            assert wandb_rows[step][f"epoch/{key}"] == value, key
    # The logging steps: the same numbers in both, the console's to its printed digits, and
    # at an epoch's last step the epoch's own training loss and accuracy.
    for key in ("train_loss", "train_acc", "lr", "images_per_sec", "data_wait_share"):
        series = mlflow_series(f"train/{key}")
        assert series == {step: row[f"train/{key}"] for step, row in wandb_rows.items()}
        for step, printed in steps.items():
            if key in printed:
                assert series[step] == pytest.approx(printed[key], rel=0.01, abs=1e-4)
    for record in history:
        step = record["epoch"] * 6
        assert mlflow_series("train/train_loss")[step] == record["train_loss"]
        assert mlflow_series("train/train_acc")[step] == record["train_acc"]


@pytest.mark.parametrize("package", ["mlflow", "wandb", "sqlalchemy"])
def test_a_missing_tracker_package_is_one_line_and_exit_2(
    package, tiny_dataset, tmp_path: Path, monkeypatch, capsys
):
    """``--log_to mlflow`` or ``wandb`` without its package (or MLflow's local store without
    SQLAlchemy, as mlflow-skinny installs): one error line naming the install, exit code 2."""
    import imgtrainer.run.train as train_ddp

    monkeypatch.setitem(sys.modules, package, None)  # what an uninstalled package does
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = "wandb" if package == "wandb" else "mlflow"
    flags = ["--device", "cpu", "--train_dir", *tiny_dataset[:1], "--val_dir", tiny_dataset[1]]
    flags += [*TINY_FLAGS, "--model", "test_resnet", "--no_tensorboard", "--log_to", tracker]
    line = user_error_line(train_ddp.main, flags, capsys, cwd=tmp_path)
    if package == "sqlalchemy":
        assert "needs SQLAlchemy: pip install mlflow" in line
        assert str(tmp_path / "logs" / "mlflow.db") in line
    else:
        assert f"--log_to {package} needs the {package} package" in line
        assert f"pip install {package}" in line
    assert not (tmp_path / "logs" / "tracker_runs.json").exists()


def closed_port_url() -> str:
    """An address on this machine where nothing listens: a server that is gone."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@needs_trackers
@pytest.mark.slow
def test_a_wandb_without_login_is_one_line(tmp_path: Path, monkeypatch):
    """W&B online without a login (the real package): one line naming the fixes, no run kept."""
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no W&B settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "config"))
    monkeypatch.setenv("WANDB_BASE_URL", closed_port_url())  # never the real server
    with pytest.raises(UserError) as err:
        build_trackers("wandb", TrackerContext(TrainConfig(), tmp_path, 0, 6))
    line = str(err.value)
    assert "No API key configured" in line and "WANDB_MODE=offline" in line
    assert "wandb login" in line and "\n" not in line
    assert not (tmp_path / "tracker_runs.json").exists()


@needs_trackers
@pytest.mark.slow
def test_an_mlflow_server_gone_is_one_line_at_the_start_and_switched_off_mid_run(
    tmp_path: Path, monkeypatch, caplog
):
    """The real MLflow: a server that cannot be reached is one line within seconds (MLflow's own
    retries would take 4 minutes); one that goes away mid-run switches the tracker off with one
    warning, and the training goes on."""
    import mlflow

    from imgtrainer.reports.trackers.mlflow_tracker import HTTP_RETRIES

    for name in HTTP_RETRIES:  # the tracker sets its defaults: restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    gone = closed_port_url()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", gone)
    started = time.monotonic()
    with pytest.raises(UserError) as err:
        build_trackers("mlflow", TrackerContext(TrainConfig(), tmp_path, 0, 6))
    assert time.monotonic() - started < 30
    line = str(err.value)
    assert f"--log_to mlflow could not start a run at {gone}" in line
    assert "MLFLOW_TRACKING_URI" in line and "\n" not in line

    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the local store in the log folder
    (tracker,) = build_trackers("mlflow", TrackerContext(TrainConfig(), tmp_path, 0, 6))
    tracker.on_log_step(3, {"train_loss": 1.0})
    local = mlflow.get_tracking_uri()
    assert local == f"sqlite:///{tmp_path / 'mlflow.db'}"
    try:
        mlflow.set_tracking_uri(gone)  # the server goes away
        tracker.on_log_step(6, {"train_loss": 0.5})
        tracker.on_epoch_end(1, {"epoch": 1})
    finally:
        mlflow.set_tracking_uri(local)
        mlflow.end_run()
    assert not tracker.enabled
    warnings = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("--log_to mlflow failed (")
    assert warnings[0].endswith("it is off from now on")
    run_id = json.loads((tmp_path / "tracker_runs.json").read_text())["mlflow"]
    history = mlflow.MlflowClient(local).get_metric_history(run_id, "train/train_loss")
    assert [(m.step, m.value) for m in history] == [(3, 1.0)]

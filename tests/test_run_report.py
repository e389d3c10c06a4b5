"""The report of a real run: written when the run ends, again by ``src/utils.py --report``
without torch, and the same page from ``src/evaluate.py --report``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import SRC, run_main, write_image_folder
from imgtrainer.reports.predictions import BEST_PREDICTIONS, Predictions
from imgtrainer.tools.evaluate import main as evaluate_main
from test_report_page import Page


def test_a_finished_run_leaves_its_report_with_the_best_epochs_predictions(trained_run):
    logs = trained_run.root / "logs"
    history = json.loads((logs / "training_history.json").read_text())
    best = history["best"]
    assert best["metric"] == "val_acc" and best["epoch"] in (1, 2)
    assert all(0 <= r["data_wait_share"] <= 1 for r in history["epochs"])
    assert history["train_class_counts"] == [16, 16, 16]
    assert history["environment"]["precision"] == "float32"
    predictions = Predictions.load(logs / BEST_PREDICTIONS)
    assert predictions.about["epoch"] == best["epoch"] and len(predictions) == 15
    record = history["epochs"][best["epoch"] - 1]
    assert predictions.top1 == record["val_acc"]  # the pass that scored the epoch
    assert sorted(predictions.locations) == sorted(
        str(path) for path in trained_run.val.rglob("*.jpg")
    )
    text = (logs / "report.html").read_text()
    page = Page(text)
    assert page.rows["per-class"] == 3 and page.rows["epochs"] == 2
    assert len(page.captions["gallery"]) == 15
    assert all(src.startswith("data:image/") for src in page.images)
    assert pictures(page) == 15 == len(page.images)  # the curves are inline SVG
    assert text.count("<svg class='chart'") >= 6
    assert "Done: best val_acc" in text
    log = (logs / "train_rank_0.log").read_text()
    assert "Report: logs/report.html (" in log
    # What the page read: the run's events, each with its fields and its sentence.
    events = {e["kind"]: e for e in history["events"]}
    kinds = ["start", "data", "image_cache", "loader", "memory", "training", "batch", "done"]
    assert [e["kind"] for e in history["events"]] == kinds[:2] + kinds[1:]
    assert (events["start"]["attempt"], events["start"]["rerun"]) == (
        0,
        "python launch_ddp.py --config logs/config.yaml",
    )
    training, validation = history["events"][1:3]
    assert (training["role"], training["images"], training["classes"]) == ("Training", 48, 3)
    assert (validation["role"], validation["images"], validation["layout"]) == (
        "Validation",
        15,
        "folder",
    )
    assert (events["loader"]["workers"], events["memory"]["micro_batch"]) == (0, 8)
    assert events["batch"]["global_batch"] == history["effective_batch_size"]
    assert events["done"]["finished"] and events["done"]["epoch"] == 2
    assert events["start"]["until"] >= events["done"]["time"]  # the last write of the history
    assert all(e["text"] in log for e in history["events"] if e["kind"] != "done")
    assert "start 1 at " in text and ": a new run</li>" in text


def pictures(page: Page) -> int:
    """The pictures of images among a page's images (JPEG; the figures are PNG)."""
    return sum(src.startswith("data:image/jpeg") for src in page.images)


def test_utils_report_rebuilds_the_page_without_torch(trained_run, tmp_path: Path):
    logs = trained_run.copy_to(tmp_path) / "logs"
    (logs / "report.html").unlink()
    code = (
        "import sys\n"
        "from imgtrainer.tools.plot import main\n"
        "code = main(['--report', 'logs'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Report: logs/report.html (")
    page = Page((logs / "report.html").read_text())
    # Run from the run's own folder: the validation images are found again.
    assert page.rows["per-class"] == 3 and pictures(page) == 15


def test_evaluate_report_shows_the_per_class_table_and_the_mistakes(trained_run, tmp_path: Path):
    # Pixels that tell no class apart: the model gets some of them wrong.
    data = write_image_folder(tmp_path / "noise", ["cat", "dog", "fox"], 10, coloured=False)
    common = ["--data_dir", data, "--device", "cpu", "--num_workers", "0"]
    code = run_main(
        evaluate_main,
        ["--checkpoint", trained_run.best, "--report", "--output", tmp_path / "one", *common],
    )
    assert code == 0
    page = Page((tmp_path / "one" / "report.html").read_text())
    metrics = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert page.rows["per-class"] == 3 and len(page.captions["gallery"]) == 24
    rows = [min(8, c["images"] - c["correct"]) for c in metrics["per_class"].values()]
    assert pictures(page) == 24 + sum(rows)


def test_evaluate_needs_a_checkpoint(capsys):
    assert run_main(evaluate_main, []) == 2
    assert "the following arguments are required: --checkpoint" in capsys.readouterr().err

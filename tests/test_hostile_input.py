"""Odd but valid input, as the security review (2026-11c) reproduced it: a folder that links back
to itself, tar members named with any bytes, hand-made shard indices, histories of another
shape, class names matplotlib would read as TeX, file names with newlines. Each gives a result
or one line, never a traceback and never an image twice."""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CLASSES, TINY_FLAGS, entries_of, run_train
from imgtrainer.data.layouts import open_datasets
from imgtrainer.data.layouts.folder_checks import count_images
from imgtrainer.data.layouts.image_files import images_under
from imgtrainer.errors import UserError
from imgtrainer.reports.confusion import plot_confusion_matrix
from imgtrainer.reports.history import checked_history
from imgtrainer.reports.page.curves import load_history
from imgtrainer.reports.page.run_report import build_run_report
from imgtrainer.reports.predictions import Predictions
from imgtrainer.tools.inference import checkpoint_history
from support.harness import run_cli, write_image_folder

ROOT = Path(__file__).resolve().parents[1]


def looped_folder(root: Path) -> Path:
    """3 images of class ``a`` and 2 of ``b``; ``a/again`` links back to ``a``."""
    folder = write_image_folder(root, ["a", "b"], 3)
    (folder / "b" / "img_002.jpg").unlink()
    os.symlink(".", folder / "a" / "again")
    return folder


def test_a_folder_that_links_back_to_itself_is_read_once(tmp_path: Path, caplog):
    folder = looped_folder(tmp_path / "train")
    with caplog.at_level(logging.WARNING):
        table = open_datasets(str(folder), str(folder))[0]
    assert sorted(table.labels.tolist()) == [0, 0, 0, 1, 1]
    skipped = [r.message for r in caplog.records if "already read" in r.message]
    assert skipped and all("again" in line for line in skipped)
    assert count_images(folder, ["a", "b"]) == {"a": 3, "b": 2}
    assert len(images_under(folder, warn=lambda line: None)) == 5


def test_prepare_data_puts_no_image_of_a_looped_folder_in_both_splits(tmp_path: Path):
    """The review's repro: 3 images became 123, with copies of the same pixels in val and train."""
    folder = looped_folder(tmp_path / "source")
    out = tmp_path / "out"
    args = ["--source", folder, "--output", out, "--val_ratio", "0.34"]
    result = run_cli([ROOT / "src" / "prepare_data.py", *args], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "already read (through a link): skipped" in result.stderr
    written = [p for p in out.rglob("*.jpg")]
    assert len(written) == 5
    pixels = [p.read_bytes() for p in written]
    assert len(set(pixels)) == 5  # no image in both train and val


# ----------------------------------------------------------------------------- tar shards

ODD_NAMES = ["bad\nname0", "tab\there1", "\udce9t\udce92", "plain3"]  # \udce9: the byte 0xE9


def odd_shard(folder: Path, out: Path) -> list[bytes]:
    """A shard whose members are named with a newline, a tab and a byte that is not UTF-8."""
    entries, classes = entries_of(folder)
    out.mkdir()
    (out / "classes.txt").write_text("\n".join(classes) + "\n")
    images = []
    with tarfile.open(out / "odd.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for key, (path, label) in zip(ODD_NAMES * 3, entries, strict=False):
            key = f"{len(images)}_{key}"
            for name, data in ((f"{key}.jpg", path.read_bytes()), (f"{key}.cls", b"%d" % label)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            images.append(path.read_bytes())
    return images


def test_tar_members_named_with_any_bytes_train_and_their_index_is_read_back(tmp_path: Path):
    folder = write_image_folder(tmp_path / "images", CLASSES, 4)
    images = odd_shard(folder, tmp_path / "shards")
    spec = str(tmp_path / "shards" / "*.tar")
    for _ in range(2):  # built, then read back from the index it kept
        table = open_datasets(spec, spec)[0]
        assert [table.read(i) for i in range(len(table))] == images
    assert "\udce9t\udce9" in table.location(2) and "bad\nname" in table.location(0)
    workdir = tmp_path / "run"
    workdir.mkdir()
    flags = ["--train_data", spec, "--val_data", spec, *TINY_FLAGS, "--epochs", "1"]
    assert run_train(flags, cwd=workdir) == 0
    state = torch.load(workdir / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    assert state["epoch"] == 1


@pytest.mark.parametrize(
    "index",
    [
        "garbage",
        "imgtrainer-tar-index 1 {size} {time}\n0\t1\t0\tname\n",  # the first version's
        "{stamp}\n0\t1\n",  # cut short
        '{stamp}\nx\ty\tz\t"n"\n',
        "{stamp}\n0\t1\t0\tnot json\n",
        '{stamp}\n0\t-5\t0\t"n"\n',
        "{stamp}\n0\t1\t0\t[1]\n",
    ],
)
def test_a_stale_or_hand_made_shard_index_is_built_again(tmp_path: Path, index: str):
    import imgtrainer.data.layouts.shards as shards

    folder = write_image_folder(tmp_path / "images", CLASSES, 2)
    images = odd_shard(folder, tmp_path / "shards")
    shard = str(tmp_path / "shards" / "odd.tar")
    stamp = shards._stamp(shard)
    _, size, time = stamp.split(" ")[-3:] if stamp.count(" ") >= 4 else ("", "", "")
    kept = Path(shard + shards.INDEX_SUFFIX)
    kept.write_text(index.format(stamp=stamp, size=size, time=time))
    table = open_datasets(shard, shard)[0]
    assert [table.read(i) for i in range(len(table))] == images
    assert kept.read_text().startswith(stamp + "\n")  # kept again, right


# ----------------------------------------------------------------------------- histories

RECORD = {"epoch": 1, "train_loss": 1.0, "train_acc": 0.5, "lr": 0.1}
ODD_HISTORIES = [
    {"epochs": [1, 2]},
    {"epochs": [], "config": "x"},
    {"epochs": [RECORD], "best": {"epoch": "x"}},
    {"epochs": [{**RECORD, "val_acc": "0.5", "val_loss": 1, "val_top5": 1}], "best": {"epoch": 1}},
    {"epochs": [{}]},
    {"epochs": [{**RECORD, "epoch": True}]},
    {"epochs": [RECORD], "class_names": [1, 2]},
    {"epochs": [RECORD], "events": ["start"]},
    {"epochs": [RECORD], "best": {"metric": ["val_acc"]}},
    [],
    "history",
]


@pytest.mark.parametrize("history", ODD_HISTORIES, ids=range(len(ODD_HISTORIES)))
def test_a_history_of_another_shape_is_no_history(tmp_path: Path, history):
    """The review's repros: each crashed ``utils.py --report`` or ``--history`` with a traceback.
    The page is built without it; plotting it is one line."""
    with pytest.raises(ValueError):
        checked_history(history)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "training_history.json").write_text(json.dumps(history))
    page = build_run_report(logs)
    assert "<html" in page
    with pytest.raises(UserError, match="is not a training history file"):
        load_history(logs / "training_history.json")


def test_a_checkpoint_whose_history_has_another_shape_gives_a_report_without_curves():
    """The review's probe/odd.pth: a string best_epoch crashed evaluate --report in its curves."""
    state = {"history": [RECORD], "best_epoch": "x", "config": {}}
    assert checkpoint_history(state) is None
    state["best_epoch"] = 1
    assert checkpoint_history(state)["best"]["epoch"] == 1
    assert checkpoint_history({"history": "x"}) is None


def test_the_run_report_cli_takes_a_history_of_any_shape(tmp_path: Path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "training_history.json").write_text(json.dumps(ODD_HISTORIES[2]))
    result = run_cli([ROOT / "src" / "utils.py", "--report", logs], tmp_path, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert (logs / "report.html").is_file()
    result = run_cli(
        [ROOT / "src" / "utils.py", "--history", logs / "training_history.json", "--output", "c"],
        tmp_path,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


# ----------------------------------------------------------------------------- names


def test_class_names_that_matplotlib_would_read_as_tex_are_drawn_as_written(tmp_path: Path):
    names = ["$\\notacommand$", "b$", "=1+2"]
    out = tmp_path / "cm.png"
    plot_confusion_matrix(np.eye(3, dtype=int), names, out, title="data $in$ /tmp/$x$")
    assert out.stat().st_size > 0


def test_a_file_name_with_a_newline_keeps_its_prediction_row(tmp_path: Path):
    """The review's F14: a newline in a location shifted every later row."""
    predictions = Predictions(
        ["a", "b"],
        ["x/a\nb.jpg", "y\udce9.jpg"],
        np.array([0, 1]),
        np.array([0, 0]),
        np.array([0.9, 0.6], dtype=np.float32),
        np.array([0.1, 0.9], dtype=np.float32),
        {"epoch": 1},
    )
    predictions.save(tmp_path / "p.npz")
    loaded = Predictions.load(tmp_path / "p.npz")
    assert loaded.locations == predictions.locations and len(loaded) == 2


@pytest.mark.parametrize("fields", [{"effective_batch_size": 1}, {"config": None}])
def test_the_checkpoints_fuzzing_found_resume_with_one_line(fields):
    """Found by tests/test_fuzz.py: a checkpoint with an effective batch but no layout or
    config (TypeError), or a None config (AttributeError), ended a resume with a traceback."""
    from imgtrainer.checkpoints.files import CheckpointError
    from imgtrainer.checkpoints.resume import check_resume_fits, check_resume_settings
    from imgtrainer.config import TrainConfig

    state = {"model_state_dict": {}, "optimizer_state_dict": {}, "epoch": 0, **fields}
    config = TrainConfig().to_dict()
    check_resume_fits(state, Path("x.pth"), ["a"], "resnet18", "adamw")
    try:
        check_resume_settings(state, Path("x.pth"), config, 2, override=False)
    except CheckpointError as err:
        assert "\n" not in str(err)


def test_csv_cells_that_would_start_a_formula_are_written_as_text(tmp_path: Path):
    """F12: a class folder named ``=1+2`` became a formula in confusion_matrix.csv and
    misclassified.csv; numbers, negative ones too, stay numbers."""
    import csv

    from imgtrainer.reports.confusion import write_confusion_csv
    from imgtrainer.reports.trackers.csv_file import metrics_csv

    names = ["=1+2", "+x", "-y", "@z", "\tt", "plain"]
    write_confusion_csv(np.eye(6, dtype=int), names, tmp_path / "c.csv")
    rows = list(csv.reader(open(tmp_path / "c.csv", newline="")))
    assert rows[0][1:] == ["'=1+2", "'+x", "'-y", "'@z", "'\tt", "plain"]
    assert [row[0] for row in rows[1:]] == rows[0][1:] and rows[1][1] == "1"
    table = list(csv.reader(io.StringIO(metrics_csv([{"epoch": 1, "lr": -0.5, "note": "=cmd"}]))))
    assert table == [["epoch", "lr", "note"], ["1", "-0.5", "'=cmd"]]


def test_rows_never_name_an_address_outside_files_and_their_own_store(tmp_path: Path):
    """F10: a list or Parquet row naming http://... was fetched (a blind request to any address
    a dataset names), and a bucket's list could reach another bucket through ../."""
    from imgtrainer.data.layouts.files import list_table
    from imgtrainer.data.layouts.parquet import image_bytes
    from imgtrainer.storage import join, row_may_name

    assert row_may_name("data/train.csv", "/abs/img.jpg")  # the Hub's {bytes: None, path}
    assert row_may_name("data/train.csv", "s3://bucket/img.jpg")  # a list of objects
    assert row_may_name("s3://bkt/lists/a.csv", "/local/img.jpg")
    assert row_may_name("s3://bkt/lists/a.csv", join("s3://bkt/lists", "../img.jpg"))
    assert not row_may_name("s3://bkt/lists/a.csv", join("s3://bkt/lists", "../../other/x.jpg"))
    assert not row_may_name("data/train.csv", "http://127.0.0.1:9/latest/meta-data")
    listed = tmp_path / "train.csv"
    listed.write_text("path,label\na.jpg,cat\nhttp://169.254.169.254/latest/meta-data,dog\n")
    with pytest.raises(UserError, match=r"train.csv, line 3: 'http://169.254.169.254/.*not read"):
        list_table(str(listed), None)
    with pytest.raises(OSError, match="not read"):  # a Parquet cell: left out as unreadable
        image_bytes({"bytes": None, "path": "https://example.com/x.jpg"}, "p.parquet[row 0]")


def test_links_planted_in_a_shared_folder_are_never_written_through(tmp_path: Path):
    """F7: the checkpoint folder's .lock and the temporary file of every atomic write followed a
    link planted there (a group-writable scratch folder), truncating or filling its target."""
    from imgtrainer.checkpoints.run_folder import FolderLock
    from imgtrainer.files import atomic_write

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "ck"
    folder.mkdir()
    os.symlink(victim, folder / ".lock")
    with pytest.raises(UserError, match="remove it if it is a link"):
        FolderLock(folder).acquire()
    target = tmp_path / "logs" / "training_history.json"
    target.parent.mkdir()
    os.symlink(victim, target.with_name(f".{target.name}.{os.getpid()}.tmp"))
    atomic_write(target, lambda f: f.write(b"{}"), lambda: 2)
    assert victim.read_text() == "precious"
    assert target.read_text() == "{}" and not target.is_symlink()


def test_the_pages_policy_allows_no_form_nor_base(tmp_path: Path):
    """F13: the policy blocked scripts but not forms or <base> (the one unescaped sink, the best
    epoch, is escaped now, and a history whose best epoch is not a number is no history)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    history = {"epochs": [RECORD], "best": {"epoch": 1}, "config": {}}
    (logs / "training_history.json").write_text(json.dumps(history))
    page = build_run_report(logs)
    assert "form-action 'none'" in page and "base-uri 'none'" in page


def test_a_list_line_without_its_label_is_named(tmp_path: Path):
    """F15: a short line was reported as "the labels are class indices; give --class_names"."""
    from imgtrainer.data.layouts.files import list_table

    listed = tmp_path / "train.csv"
    listed.write_text("path,label\na.png,cat\nb.png\n")
    with pytest.raises(UserError, match=r"train.csv, line 3: no path or label value"):
        list_table(str(listed), None)


def test_an_object_no_listing_saw_is_cached_for_this_run_only():
    """F16: a list's image URLs had a versionless cache key, so a changed object was served
    stale from the byte cache by a later run."""
    from imgtrainer.storage import UNLISTED, Store

    key = Store().cache_key("s3://bucket/never-listed.jpg")
    assert key.endswith(UNLISTED) and str(os.getpid()) in UNLISTED

"""src/predict.py: a tiny model trained on the separable colour set predicts its classes back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import (
    CLASSES,
    run_main,
    user_error_line,
    write_image_folder,
)
from imgtrainer.tools.predict import main as predict_main


@pytest.fixture(scope="module")
def trained(trained_run, tmp_path_factory) -> tuple[Path, Path]:
    """(the shared run's best checkpoint, a folder of new images of its classes)."""
    root = tmp_path_factory.mktemp("photos")
    photos = write_image_folder(root / "photos", CLASSES, 3, seed=7, ext="png")
    write_image_folder(root / "photos" / "more" / "deeper", CLASSES, 1, seed=8)  # recursion
    return trained_run.best, photos


def test_folder_predictions_are_the_trained_classes(trained, capsys):
    checkpoint, photos = trained
    (photos / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (photos / "dog" / "notes.txt").write_text("ignored: not an image")
    capsys.readouterr()
    assert (
        run_main(
            predict_main,
            [
                "--checkpoint",
                checkpoint,
                photos,
                "--json",
                "--topk",
                "2",
                "--batch_size",
                "4",
                "--device",
                "cpu",
            ],
        )
        == 0
    )
    out, err = capsys.readouterr()
    records = json.loads(out)
    by_name = {Path(r["path"]).relative_to(photos).as_posix(): r for r in records}
    assert len(records) == 3 * 3 + 3 + 1  # recursive; the text file skipped
    assert "error" in by_name["dog/broken.jpg"] and "predictions" not in by_name["dog/broken.jpg"]
    for name, record in by_name.items():
        if name == "dog/broken.jpg":
            continue
        true_class = name.split("/")[-2]  # the class folder it came from
        top = record["predictions"]
        assert len(top) == 2 and top[0]["class"] == true_class, (name, top)
        assert 0.0 <= top[1]["probability"] <= top[0]["probability"] <= 1.0
    assert "1 of 13 file(s) could not be read" in err


def test_table_by_default_with_class_names(trained, tmp_path: Path, capsys):
    checkpoint, photos = trained
    single = photos / "cat" / "img_000.png"
    assert (
        predict_main(
            ["--checkpoint", str(checkpoint), str(single), "--topk", "5", "--device", "cpu"]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("file") and len(lines) == 2
    assert lines[1].startswith(str(single)) and lines[1].split()[1] == "cat"
    assert all(name in lines[1] for name in CLASSES)  # top 5 of 3 classes: all 3


def error_line(argv: list, capsys) -> str:
    return user_error_line(predict_main, argv, capsys)


def test_missing_checkpoint_in_process(tmp_path: Path, capsys):
    photos = write_image_folder(tmp_path / "photos", ["x"], 1)
    line = error_line(["--checkpoint", tmp_path / "missing.pth", photos], capsys)
    assert "missing.pth" in line and "does not exist" in line


def test_checkpoint_of_another_tool(tmp_path: Path, capsys):
    photos = write_image_folder(tmp_path / "photos", ["x"], 1)
    torch.save({"state_dict": {"w": torch.zeros(1)}}, tmp_path / "other.pth")
    assert "class_names" in error_line(["--checkpoint", tmp_path / "other.pth", photos], capsys)


def test_empty_folder_and_missing_file(trained, tmp_path: Path, capsys):
    checkpoint, _ = trained
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no images here")
    assert "holds no image files" in error_line(
        ["--checkpoint", checkpoint, tmp_path / "empty"], capsys
    )
    assert "does not exist" in error_line(
        ["--checkpoint", checkpoint, tmp_path / "nope.jpg"], capsys
    )
    assert "--topk" in error_line(
        ["--checkpoint", checkpoint, tmp_path / "empty", "--topk", "0"], capsys
    )

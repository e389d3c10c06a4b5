"""Robust loading: non-images ignored, undecodable images found by a check beside training and
left out with one warning (the next image in each one's place), every colour mode turned into
RGB, EXIF orientation honoured, a class left empty refused."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import imgtrainer.run.train as train_ddp
from conftest import (
    ONE_CPU_PROCESS,
    TINY_FLAGS,
    data_config,
    folder_images,
    run_train,
    user_error_line,
    write_image_folder,
)
from imgtrainer.data.layouts.image_files import UNREADABLE_LIST, find_unreadable, open_rgb
from imgtrainer.data.layouts.table import READABLE, UNREADABLE
from imgtrainer.data.loaders import build_datasets, train_augmentation
from imgtrainer.errors import UserError


def add_bad_files(folder: Path) -> dict[str, Path]:
    """A truncated JPEG, garbage named .jpg, a text file and a CMYK JPEG in ``folder``."""
    good = next(folder.glob("*.jpg")).read_bytes()
    files = {
        "truncated": folder / "truncated.jpg",
        "garbage": folder / "garbage.jpg",
        "text": folder / "readme.txt",
        "cmyk": folder / "cmyk.jpg",
    }
    files["truncated"].write_bytes(good[: len(good) // 2])
    files["garbage"].write_bytes(b"this is not a JPEG at all" * 10)
    files["text"].write_text("a text file in a class folder")
    Image.new("CMYK", (20, 20), (0, 255, 255, 0)).save(files["cmyk"])
    return files


@pytest.mark.parametrize(
    "mode, colour",
    [
        ("L", 128),
        ("P", 3),
        ("CMYK", (0, 255, 255, 0)),
        ("RGBA", (10, 200, 30, 255)),
        ("LA", (50, 255)),
        ("I;16", 300),
        ("1", 1),
    ],
)
def test_every_colour_mode_becomes_rgb(tmp_path: Path, mode, colour):
    path = tmp_path / ("image.tif" if mode == "I;16" else "image.png")
    if mode == "CMYK":
        path = tmp_path / "image.jpg"
    Image.new(mode, (6, 4), colour).save(path)
    image = open_rgb(path)
    assert image.mode == "RGB" and image.size == (6, 4)


def test_transparent_pixels_become_white(tmp_path: Path):
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    assert open_rgb(tmp_path / "clear.png").getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_honoured(tmp_path: Path):
    pixels = np.zeros((10, 30, 3), dtype=np.uint8)  # 30 wide, 10 high, left third red
    pixels[:, :10] = (255, 0, 0)
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    image.save(tmp_path / "portrait.jpg", exif=exif, quality=95)
    upright = open_rgb(tmp_path / "portrait.jpg")
    assert upright.size == (10, 30)
    red, green, _ = upright.getpixel((5, 2))  # the red band is now on top
    assert red > 200 and green < 60


def test_scan_finds_undecodable_files_only(tmp_path: Path):
    write_image_folder(tmp_path / "a", ["x"], 3)
    files = add_bad_files(tmp_path / "a" / "x")
    images = sorted(str(p) for p in (tmp_path / "a" / "x").glob("*.jpg"))
    unreadable = find_unreadable(images)
    assert set(unreadable) == {str(files["truncated"]), str(files["garbage"])}
    assert "truncated" in unreadable[str(files["truncated"])].lower()
    # Long lists go through the thread pool: same answer.
    many = images * (300 // len(images) + 1)
    assert find_unreadable(many, workers=2) == unreadable


def test_datasets_leave_out_bad_files_with_one_warning(tmp_path: Path, caplog):
    train = write_image_folder(tmp_path / "train", ["cat", "dog"], 4)
    val = write_image_folder(tmp_path / "val", ["cat", "dog"], 2)
    add_bad_files(train / "dog")
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        cfg = data_config(
            train,
            val,
            image_size=16,
            seed=0,
            crop_scale_min=0.5,
            hflip=0.5,
            log_dir=str(tmp_path / "logs"),
        )
        datasets = build_datasets(cfg, ONE_CPU_PROCESS)
        train_set, val_set = datasets.train, datasets.val
        folder = train_set.images  # cat: 4 images; dog: cmyk, garbage, 4 images, truncated
        assert len(train_set) == 11  # every listed image keeps its place in the order
        # Before the check is in (or after), a bad image gives the next one, silently.
        assert np.array_equal(np.asarray(folder[5][0]), np.asarray(folder[6][0]))
        assert folder[5][1] == folder[6][1] == 1
        assert np.array_equal(np.asarray(folder[10][0]), np.asarray(folder[0][0]))
        assert folder[10][1] == 0  # the last wraps round to the first
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]
        unreadable = datasets.check.finish()
    assert datasets.class_names == ["cat", "dog"]
    assert {Path(p).name for p in unreadable} == {"garbage.jpg", "truncated.jpg"}
    assert list(folder.states.array) == [READABLE] * 5 + [UNREADABLE] + [READABLE] * 4 + [
        UNREADABLE
    ]
    assert len(val_set) == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "2 of 15 image files" in warnings[0] and UNREADABLE_LIST in warnings[0]
    listed = (tmp_path / "logs" / UNREADABLE_LIST).read_text().splitlines()
    assert [Path(line.split("\t")[0]).name for line in listed] == ["garbage.jpg", "truncated.jpg"]
    pixels, params, label = train_set[(4, 0)]  # the CMYK image, as RGB
    image = train_augmentation(cfg, torch.device("cpu"))[1](pixels[None], params[None])[0]
    assert pixels.shape[0] == 3 and tuple(image.shape) == (3, 16, 16)


def test_a_file_broken_after_the_scan_does_not_stop_the_epoch(tmp_path: Path, caplog):
    folder = folder_images(write_image_folder(tmp_path / "d", ["a", "b"], 2))
    folder.states.array[:] = READABLE  # as the check found them
    first_path = folder.table.location(0)
    Path(first_path).write_bytes(b"broken later")
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        image, label = folder[0]
    assert image.mode == "RGB" and label == 0  # the next sample, a's second image
    assert "could not read" in caplog.text


def test_class_left_empty_is_refused_by_name(tmp_path: Path):
    train = write_image_folder(tmp_path / "train", ["cat", "dog"], 3)
    val = write_image_folder(tmp_path / "val", ["cat", "dog"], 2)
    for image in (train / "dog").glob("*.jpg"):
        image.write_bytes(b"corrupt")
    (train / "dog" / "labels.csv").write_text("x")
    cfg = data_config(train, val, image_size=16, seed=0, crop_scale_min=0.5, hflip=0.5)
    with pytest.raises(UserError, match="dog"):
        build_datasets(cfg, ONE_CPU_PROCESS).check.finish()


def test_training_runs_end_to_end_past_corrupt_text_and_cmyk_files(
    tiny_dataset, tmp_path: Path, capsys
):
    train, val = tiny_dataset
    add_bad_files(train / "dog")
    add_bad_files(val / "fox")
    capsys.readouterr()
    assert (
        run_train(
            ["--train_dir", train, "--val_dir", val, "--epochs", "1", *TINY_FLAGS], cwd=tmp_path
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    warnings = [line for line in out.splitlines() if "cannot be decoded" in line]
    assert len(warnings) == 1 and "4 of 69 image files" in warnings[0]
    assert "logs/unreadable_images.txt" in warnings[0]
    assert len((tmp_path / "logs" / UNREADABLE_LIST).read_text().splitlines()) == 4
    assert "Done: best val_acc" in out


def test_training_refuses_a_class_with_only_corrupt_images(tiny_dataset, tmp_path: Path, capsys):
    train, val = tiny_dataset
    for image in (val / "fox").glob("*.jpg"):
        image.write_bytes(b"corrupt")
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", "--train_dir", train, "--val_dir", val, *TINY_FLAGS],
        capsys,
        cwd=tmp_path,
    )
    assert "fox" in line and "no readable image" in line

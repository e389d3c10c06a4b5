"""Every image is checked once (a reduced-scale decode) beside the first epoch; the RAM cache
decodes nothing at start, and each image once as a step first reads it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import imgtrainer.data.layouts.image_files as image_files
import imgtrainer.data.layouts.table as table
import imgtrainer.data.loaders as data
from conftest import CLASSES, ONE_CPU_PROCESS, data_config, write_image_folder


@pytest.fixture
def decodes(monkeypatch) -> dict[str, int]:
    """How many times the decode check and the cache open an image file."""
    counts = {"check": 0, "cache": 0}
    real_open = table.open_rgb

    def counted_open(path, draft=None):
        if draft == image_files.CHECK_DRAFT_SIZE:
            counts["check"] += 1
        elif draft is not None:  # the caches' decode (decode_resized); a plain read: None
            counts["cache"] += 1
        return real_open(path, draft)

    monkeypatch.setattr(table, "open_rgb", counted_open)  # a table's images: the caches
    monkeypatch.setattr(image_files, "open_rgb", counted_open)  # one image's check
    return counts


def folders_with_a_broken_file(root: Path) -> tuple[Path, Path]:
    train = write_image_folder(root / "train", CLASSES, 4, seed=1)
    val = write_image_folder(root / "val", CLASSES, 2, seed=2)
    (train / CLASSES[0] / "broken.jpg").write_bytes(b"not a jpeg")
    return train, val


@pytest.mark.parametrize("cache", ["none", "ram"])
def test_each_image_is_checked_beside_training_cached_once_and_a_broken_one_left_out_alike(
    cache: str, tmp_path: Path, decodes: dict[str, int], caplog
):
    train, val = folders_with_a_broken_file(tmp_path)
    files = 3 * 4 + 1 + 3 * 2
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        cfg = data_config(
            train, val, image_size=16, seed=0, log_dir=str(tmp_path / "logs"), cache_images=cache
        )
        train_set, val_set, _, check = data.build_datasets(cfg, ONE_CPU_PROCESS, threads=1)
        assert decodes["cache"] == 0  # the cache decodes nothing before a step reads
        assert [Path(p).name for p in check.finish()] == ["broken.jpg"]
    assert decodes == {"check": files, "cache": 0}  # a few images: by the check's thread
    assert len(train_set) == 13 and len(val_set) == 6  # the broken image's place stays
    for _ in range(2):
        for index in range(13):
            train_set.images[index]  # the broken one (index 0) gives the next image
        for index in range(6):
            val_set.images[index]
    assert decodes["cache"] == (18 if cache == "ram" else 0)  # once each, then from memory
    assert decodes["check"] == files  # still once each; ram: the broken one never tried (18)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"1 of {files} image files cannot be decoded" in warnings[0]
    assert "broken.jpg" in (tmp_path / "logs" / "unreadable_images.txt").read_text()

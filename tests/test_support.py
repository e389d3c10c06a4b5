"""tests/support's own logic on the CPU: the data sets the GPU checks and the benchmarks write."""

from __future__ import annotations

import numpy as np
from PIL import Image

from support.harness import write_split_folder


def sizes_of(folder) -> list[tuple[int, int]]:
    sizes = []
    for path in sorted(folder.rglob("*.jpg")):
        with Image.open(path) as image:
            sizes.append(image.size)
    return sizes


def test_the_split_folder_holds_square_patches_one_colour_per_class(tmp_path):
    data = write_split_folder(tmp_path / "patches", 2, 3, 1, 24, noise=40, threads=2)
    assert sorted(p.name for p in (data / "train").iterdir()) == ["class_00", "class_01"]
    assert sizes_of(data / "train") == [(24, 24)] * 6 and sizes_of(data / "val") == [(24, 24)] * 2
    means = [
        np.asarray(Image.open(data / "train" / name / "img_000.jpg"), dtype=float).mean((0, 1))
        for name in ("class_00", "class_01")
    ]
    assert np.abs(means[0] - means[1]).max() > 100  # red against green: learnable
    again = write_split_folder(tmp_path / "again", 2, 3, 1, 24, noise=40, threads=1)
    same = [
        (data / split / "class_01" / "img_000.jpg").read_bytes()
        == (again / split / "class_01" / "img_000.jpg").read_bytes()
        for split in ("train", "val")
    ]
    assert same == [True, True]  # the same files for the same arguments
    # train and val are drawn with different seeds: not copies of each other
    assert (data / "train" / "class_00" / "img_000.jpg").read_bytes() != (
        data / "val" / "class_00" / "img_000.jpg"
    ).read_bytes()


def test_the_split_folder_of_photos_has_its_panorama_among_the_training_images(tmp_path):
    data = write_split_folder(tmp_path / "photos", 2, 4, 1, 500, photos=True, threads=2)
    train, val = sizes_of(data / "train"), sizes_of(data / "val")
    assert len(train) == 8 and len(val) == 2
    assert min(map(min, train + val)) >= 500
    assert [w == 4 * h for w, h in train].count(True) == 1
    assert not any(w == 4 * h for w, h in val)

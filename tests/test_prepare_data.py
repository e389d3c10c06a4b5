"""src/prepare_data.py: stratified, deterministic train/val split of a folder of class folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import SRC, assert_user_error, run_cli, user_error_line, write_image_folder
from imgtrainer.tools.prepare_data import main as prepare_main


def files_of(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink()}


def source_with_junk(root: Path) -> Path:
    """cat: 10 images, dog: 7, owl: 1 (too few), and two files that are not images."""
    write_image_folder(root, ["cat"], 10, ext="png")
    write_image_folder(root, ["dog"], 7, seed=1, ext="png")
    write_image_folder(root, ["owl"], 1, seed=2, ext="png")
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "dog" / ".DS_Store").write_bytes(b"\0")
    return root


def test_split_counts_per_class_smallest_class_and_left_out_files(tmp_path: Path, capsys):
    source = source_with_junk(tmp_path / "animals")
    assert (
        prepare_main(
            ["--source", str(source), "--output", str(tmp_path / "data"), "--val_ratio", "0.2"]
        )
        == 0
    )
    out, err = capsys.readouterr()
    counts = {
        (split, c): len(list((tmp_path / "data" / split / c).glob("*.png")))
        for split in ("train", "val")
        for c in ("cat", "dog", "owl")
    }
    # 10 * 0.2 = 2 ; 7 * 0.2 = 1.4 -> 1 ; a single image cannot be split: train only.
    assert counts == {
        ("train", "cat"): 8,
        ("val", "cat"): 2,
        ("train", "dog"): 6,
        ("val", "dog"): 1,
        ("train", "owl"): 1,
        ("val", "owl"): 0,
    }
    assert "train:     15 images" in out and "val:        3 images" in out
    assert "smallest class: owl (1 images: 1 train / 0 val)" in out
    assert "left out: 2 files that are not images" in out
    assert "too few images to split" in err and "owl" in err and "cat" not in err
    assert not list((tmp_path / "data").rglob("*.txt"))


def test_same_seed_same_split_other_seed_other_split(tmp_path: Path):
    source = write_image_folder(tmp_path / "src", ["a", "b"], 20, ext="png")
    splits = {}
    for name, seed in (("one", "3"), ("two", "3"), ("other", "4")):
        prepare_main(["--source", str(source), "--output", str(tmp_path / name), "--seed", seed])
        splits[name] = files_of(tmp_path / name / "val")
    assert splits["one"] == splits["two"]
    assert splits["one"] != splits["other"]
    assert len(splits["one"]) == len(splits["other"]) == 8


def test_finds_class_folders_nested_one_level_deeper(tmp_path: Path, capsys):
    download = tmp_path / "animals"
    write_image_folder(download / "animals", ["cat", "dog"], 5, ext="png")
    (download / "name of the animals.txt").write_text("cat\ndog\n")
    mac = download / "__MACOSX" / "animals" / "cat"  # what a zip made on a Mac adds
    mac.mkdir(parents=True)
    (mac / "._img_000.png").write_bytes(b"resource fork")
    prepare_main(
        ["--source", str(download), "--output", str(tmp_path / "data"), "--val_ratio", "0.4"]
    )
    assert sorted(p.name for p in (tmp_path / "data" / "train").iterdir()) == ["cat", "dog"]
    assert len(files_of(tmp_path / "data" / "val")) == 4
    assert f"from {download / 'animals'}" in capsys.readouterr().out


def test_link_makes_symlinks_to_the_source(tmp_path: Path):
    source = write_image_folder(tmp_path / "src", ["a"], 5, ext="png")
    prepare_main(["--source", str(source), "--output", str(tmp_path / "data"), "--link"])
    linked = list((tmp_path / "data").rglob("*.png"))
    assert len(linked) == 5 and all(p.is_symlink() for p in linked)
    assert {p.resolve().parent for p in linked} == {(source / "a").resolve()}


def test_refuses_non_empty_output_unless_forced(tmp_path: Path):
    source = write_image_folder(tmp_path / "src", ["a", "b"], 5, ext="png")
    old = tmp_path / "data" / "train" / "old" / "x.png"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"earlier split")
    (tmp_path / "data" / ".gitkeep").touch()

    result = run_cli(
        [SRC / "prepare_data.py", "--source", source, "--output", "data"], cwd=tmp_path
    )
    assert_user_error(result, "data/train is not empty", "--force")
    assert old.read_bytes() == b"earlier split"

    prepare_main(["--source", str(source), "--output", str(tmp_path / "data"), "--force"])
    assert not old.exists()
    assert (tmp_path / "data" / ".gitkeep").exists()  # only train/ and val/ are replaced
    assert (
        len(files_of(tmp_path / "data" / "train")) + len(files_of(tmp_path / "data" / "val")) == 10
    )


@pytest.mark.parametrize(
    "make_source, phrase",
    [
        (lambda p: p.mkdir(), "holds no class folders with images"),
        (lambda p: None, "does not exist"),
    ],
)
def test_empty_or_missing_source_is_one_error_line(tmp_path: Path, capsys, make_source, phrase):
    make_source(tmp_path / "empty")
    assert phrase in user_error_line(
        prepare_main, ["--source", tmp_path / "empty", "--output", tmp_path / "data"], capsys
    )


def test_force_never_deletes_the_source(tmp_path: Path, capsys):
    source = write_image_folder(tmp_path / "data" / "train", ["a"], 4, ext="png")
    with pytest.raises(SystemExit) as exit_info:
        prepare_main(["--source", str(source), "--output", str(tmp_path / "data"), "--force"])
    assert exit_info.value.code == 2
    assert "overlap" in capsys.readouterr().err
    assert len(files_of(source)) == 4


def test_extension_list_matches_torchvision():
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from imgtrainer.data.layouts.image_files import IMAGE_EXTENSIONS

    assert tuple(IMAGE_EXTENSIONS) == tuple(IMG_EXTENSIONS)

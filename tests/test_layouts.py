"""Every data layout behind one table: a folder, a list file, Parquet and tar shards give the
same samples, pixels and weights; bad rows are left out, bad inputs are one error line."""

from __future__ import annotations

import csv
import logging
import tarfile
from pathlib import Path

import pytest
import torch

import imgtrainer.run.train as train_ddp
from conftest import (
    CLASSES,
    ONE_CPU_PROCESS,
    TINY_FLAGS,
    data_config,
    entries_of,
    folder_images,
    pack_folder,
    run_train,
    user_error_line,
    write_image_folder,
)
from imgtrainer.config import parse_config
from imgtrainer.data.layouts import open_datasets
from imgtrainer.data.layouts.names import expand_pattern
from imgtrainer.data.loaders import build_datasets
from imgtrainer.errors import UserError
from imgtrainer.run.preflight import launcher_checks


def write_list(folder: Path, path: Path) -> str:
    """A list file of ``folder``'s images, paths relative to the list's folder, labels by name."""
    entries, classes = entries_of(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    delimiter = "\t" if path.suffix == ".tsv" else ","
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(["label", "path", "note"])
        for image, label in entries:
            relative = Path("..", *image.relative_to(path.parent.parent).parts)
            writer.writerow([classes[label], relative.as_posix(), "x"])
    return str(path)


def write_layouts(root: Path, per_class: int = 6) -> dict[str, tuple[str, str]]:
    """The same train and val images as a folder, a list file, Parquet and tar shards."""
    train = write_image_folder(root / "data" / "train", CLASSES, per_class, seed=1)
    val = write_image_folder(root / "data" / "val", CLASSES, 2, seed=2)
    return {
        "folder": (str(train), str(val)),
        "list": (
            write_list(train, root / "lists" / "train.csv"),
            write_list(val, root / "lists" / "val.tsv"),
        ),
        "parquet": (
            pack_folder(train, root / "pq" / "train", "parquet"),
            pack_folder(val, root / "pq" / "val", "parquet"),
        ),
        "shards": (
            pack_folder(train, root / "tar" / "train", "shards"),
            pack_folder(val, root / "tar" / "val", "shards"),
        ),
    }


# ----------------------------------------------------------------------------- same samples


def test_every_layout_gives_the_same_samples_and_pixels(tmp_path: Path):
    layouts = write_layouts(tmp_path)
    seen = {}
    for name, (train, val) in layouts.items():
        cfg = data_config(train, val, image_size=16, seed=3, log_dir=str(tmp_path / name))
        train_set, val_set, classes, check = build_datasets(cfg, ONE_CPU_PROCESS, threads=1)
        check.finish()
        samples = [train_set[(i, 1)] for i in range(len(train_set))]
        images = [val_set[i] for i in range(len(val_set))]
        seen[name] = (classes, samples, images, list(train_set.images.targets))
    classes, samples, images, targets = seen.pop("folder")
    assert classes == CLASSES and len(samples) == 18 and len(images) == 6
    for name, (other_classes, other_samples, other_images, other_targets) in seen.items():
        assert other_classes == classes and other_targets == targets, name
        for (pixels, params, label), (p2, q2, l2) in zip(samples, other_samples, strict=True):
            assert label == l2 and torch.equal(pixels, p2) and torch.equal(params, q2), name
        for (image, label), (i2, l2) in zip(images, other_images, strict=True):
            assert label == l2 and torch.equal(image, i2), name


def test_a_list_of_class_indices_takes_its_names_from_class_names(tmp_path: Path):
    train = write_image_folder(tmp_path / "train", CLASSES, 2)
    names = tmp_path / "names.txt"
    names.write_text("".join(f"{c}\n" for c in CLASSES))
    lines = ["path,label"] + [
        f"train/{c}/img_00{k}.jpg,{i}" for i, c in enumerate(CLASSES) for k in (0, 1)
    ]
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    by_list, _ = open_datasets(str(tmp_path / "train.csv"), str(train), str(names))
    by_folder = folder_images(train).table
    assert by_list.classes == CLASSES and by_list.labels.tolist() == by_folder.labels.tolist()
    assert [by_list.location(i) for i in range(6)] == [by_folder.location(i) for i in range(6)]


def test_parquet_with_plain_bytes_and_class_name_labels(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = write_image_folder(tmp_path / "train", CLASSES, 2)
    entries, classes = entries_of(folder)
    table = pa.table(
        {
            "label": [classes[label] for _, label in entries],
            "image": [path.read_bytes() for path, _ in entries],
        }
    )
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=4)
    read, _ = open_datasets(str(tmp_path / "train.parquet"), str(folder))
    assert read.classes == CLASSES and read.labels.tolist() == [label for _, label in entries]
    assert read.location(5) == f"{tmp_path / 'train.parquet'}[row 5]"
    assert read.read(5) == entries[5][0].read_bytes()  # row group 1 of 2


# ----------------------------------------------------------------------------- bad rows, bad inputs


def corrupt_parquet_row(spec: str, row: int) -> str:
    import pyarrow.parquet as pq

    path = sorted(Path(spec).glob("*.parquet"))[0]
    table = pq.read_table(path)
    images = table.column("image").to_pylist()
    images[row] = {"bytes": b"not an image", "path": images[row]["path"]}
    pq.write_table(table.set_column(0, "image", [images]), path, row_group_size=3)
    return f"{path}[row {row}]"


def corrupt_tar_member(spec: str, member: int) -> str:
    shard = Path(spec.replace("{000000..000002}", "000000"))
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    name = members[2 * member][0].name
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in members:
            data = b"garbage" if info.name == name else data
            info.size = len(data)
            tar.addfile(info, __import__("io").BytesIO(data))
    return f"{shard}:{name}"


@pytest.mark.parametrize("layout", ["parquet", "shards"])
@pytest.mark.parametrize("cache", ["none", "ram"])
def test_a_corrupt_row_or_member_is_left_out_with_one_line(layout, cache, tmp_path: Path, caplog):
    train, val = write_layouts(tmp_path)[layout]
    bad = (corrupt_parquet_row if layout == "parquet" else corrupt_tar_member)(train, 1)
    cfg = data_config(train, val, image_size=16, cache_images=cache, log_dir=str(tmp_path / "logs"))
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        train_set, _, _, check = build_datasets(cfg, ONE_CPU_PROCESS, threads=1)
        at = next(i for i in range(len(train_set)) if train_set.images.table.location(i) == bad)
        stand_in = train_set[(at, 0)]  # before the check is in: the next image, silently
        assert not caplog.records
        assert list(check.finish()) == [bad]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 of 24 image files cannot be decoded" in warnings[0]
    assert (tmp_path / "logs" / "unreadable_images.txt").read_text().startswith(bad + "\t")
    assert len(train_set) == 18  # its place in the order stays; the next image takes it
    pixels, params, label = train_set[(at, 0)]
    assert torch.equal(pixels, stand_in[0]) and torch.equal(params, stand_in[1])
    assert label == stand_in[2] == train_set.images.targets[at + 1]


def bad_inputs(root: Path) -> dict[str, tuple[list[str], str]]:
    layouts = write_layouts(root, per_class=2)
    (root / "nolabel.csv").write_text("path,class\ndata/train/cat/img_000.jpg,cat\n")
    (root / "unknown.csv").write_text("path,label\ndata/train/cat/img_000.jpg,cow\n")
    (root / "names.txt").write_text("cat\ndog\n")
    (root / "index.csv").write_text("path,label\ndata/train/cat/img_000.jpg,2\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"picture": [b"x"], "label": [0]}), root / "cols.parquet")
    shards, val = layouts["shards"]
    (Path(shards).parent / "classes.txt").unlink()
    folder_val = ["--val_data", root / "data" / "val"]
    names = ["--class_names", root / "names.txt"]
    return {
        "no label column": ([root / "nolabel.csv", *folder_val], "no 'label' column"),
        "a label not in the class names": (
            [root / "unknown.csv", *folder_val, *names],
            "the label 'cow' of row 0 is not one of the 2 class names",
        ),
        "an index past the class names": (
            [root / "index.csv", *folder_val, *names],
            "the label '2' of row 0 is not one of the 2 class names",
        ),
        "an unknown column": (
            [root / "cols.parquet", *folder_val],
            "no image column 'image' or 'img' (",
        ),
        "a range matching nothing": ([root / "none-{000..003}.tar", *folder_val], "does not exist"),
        "a glob matching nothing": ([root / "none-*.tar", *folder_val], "matches no file"),
        "shards without class names": ([shards, "--val_data", val], "no class names"),
    }


def test_bad_inputs_are_one_error_line_in_the_trainer_and_the_launcher_checks(tmp_path, capsys):
    for case, (argv, phrase) in bad_inputs(tmp_path).items():
        argv = ["--train_data", *argv]
        line = user_error_line(train_ddp.main, [*argv, *TINY_FLAGS], capsys, cwd=tmp_path)
        assert phrase in line, (case, line)
        cfg = parse_config([str(a) for a in argv])
        with pytest.raises(UserError) as raised:
            launcher_checks(cfg, "cpu", 1)
        assert phrase in str(raised.value), case


# ----------------------------------------------------------------------------- prepare_data


def test_prepare_data_round_trips_to_the_same_indices_and_pixels(tmp_path: Path, capsys):
    from imgtrainer.tools import prepare_data

    source = write_image_folder(tmp_path / "source", CLASSES, 5, seed=4)
    (source / "dog" / "broken.jpg").write_bytes(b"not an image")
    tables = {}
    for fmt in ("folder", "parquet", "shards"):
        out = tmp_path / fmt
        argv = ["--source", source, "--output", out, "--format", fmt, "--shard_size", "4"]
        assert prepare_data.main([str(a) for a in argv]) == 0
        printed = capsys.readouterr()
        if fmt != "folder":
            assert "1 of 16 image files cannot be decoded" in printed.err
        train, val = printed.out.split("--train_data ")[1].split(" --val_data ")
        tables[fmt] = open_datasets(train.strip("'"), val.strip().strip("'"))
    (tmp_path / "folder" / "train" / "dog" / "broken.jpg").unlink()  # the folder copies it
    tables["folder"] = open_datasets(
        str(tmp_path / "folder" / "train"), str(tmp_path / "folder" / "val")
    )
    for split in (0, 1):
        folder = tables["folder"][split]
        for fmt in ("parquet", "shards"):
            other = tables[fmt][split]
            assert other.classes == folder.classes and len(other) == len(folder), fmt
            assert other.labels.tolist() == folder.labels.tolist(), fmt
            for i in range(len(folder)):
                assert other.read(i) == Path(folder.location(i)).read_bytes(), (fmt, i)


# ----------------------------------------------------------------------------- training


def test_every_layout_trains_to_the_same_weights(tmp_path: Path):
    """In-process runs (1 epoch, 2 steps, seeded and deterministic) on each layout."""
    weights = {}
    for name, (train, val) in write_layouts(tmp_path).items():
        workdir = tmp_path / f"run_{name}"
        workdir.mkdir()
        flags = ["--train_data", train, "--val_data", val, *TINY_FLAGS, "--epochs", "1"]
        assert run_train([*flags, "--deterministic", "--optimizer", "sgd"], cwd=workdir) == 0
        log = (workdir / "logs" / "train_rank_0.log").read_text()
        assert "Training data: 18 images in 3 classes from " in log
        latest = workdir / "checkpoints" / "checkpoint_latest.pth"
        checkpoint = torch.load(latest, weights_only=True)
        weights[name] = checkpoint["model_state_dict"]
    folder = weights.pop("folder")
    for name, state in weights.items():
        assert state.keys() == folder.keys()
        assert all(torch.equal(state[k], folder[k]) for k in folder), name


def test_train_data_and_train_dir_are_one_flag_on_the_command_line_and_in_run_files(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("train_data: shards/{0..3}.tar\nval_dir: v.csv\n")
    assert parse_config(["--train_data", "a.csv", "--val_dir", "b"]).train_dir == "a.csv"
    assert parse_config(["--train_dir", "a", "--val_data", "b.csv"]).val_dir == "b.csv"
    cfg = parse_config(["--config", str(run_file)])
    assert (cfg.train_dir, cfg.val_dir) == ("shards/{0..3}.tar", "v.csv")


def test_a_shard_index_is_built_once_and_pax_shards_with_long_names_read_alike(
    tmp_path: Path, monkeypatch
):
    import io

    import imgtrainer.data.layouts.shards as shards

    folder = write_image_folder(tmp_path / "train", CLASSES, 2)
    entries, classes = entries_of(folder)
    (tmp_path / "pax").mkdir()
    (tmp_path / "pax" / "classes.txt").write_text("\n".join(classes) + "\n")
    with tarfile.open(tmp_path / "pax" / "a.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for n, (path, label) in enumerate(entries):
            key = f"{'long' * 30}/{n:03d}"  # a name over ustar's 100 bytes: a pax header
            for name, data in ((f"{key}.jpg", path.read_bytes()), (f"{key}.cls", b"%d" % label)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    scans = []
    real_scan = shards.scan_shard
    monkeypatch.setattr(
        shards, "scan_shard", lambda path, *rest: scans.append(path) or real_scan(path, *rest)
    )
    plain = open_datasets(pack_folder(folder, tmp_path / "plain", "shards", 4), str(folder))[0]
    pax = open_datasets(str(tmp_path / "pax" / "*.tar"), str(folder))[0]
    assert len(scans) == 1  # the pax one: prepare_data kept its 2 shards' indices
    again = open_datasets(str(tmp_path / "pax" / "*.tar"), str(folder))[0]
    assert len(scans) == 1 and again.labels.tolist() == pax.labels.tolist()
    assert pax.labels.tolist() == plain.labels.tolist() == [label for _, label in entries]
    assert [pax.read(i) for i in range(len(pax))] == [p.read_bytes() for p, _ in entries]
    assert pax.location(0) == f"{tmp_path / 'pax' / 'a.tar'}:{'long' * 30}/000.jpg"


def test_prepare_data_keeps_each_shards_index_as_a_scan_would_build_it(tmp_path: Path, monkeypatch):
    import imgtrainer.data.layouts.shards as shards

    folder = write_image_folder(tmp_path / "train", CLASSES, 3)
    pattern = pack_folder(folder, tmp_path / "tar", "shards", 4)
    scans = []
    monkeypatch.setattr(shards, "scan_shard", lambda path, *rest: scans.append(path))
    kept = [shards.shard_index(path, None) for path in expand_pattern(pattern, ".tar")]
    assert scans == [] and sum(map(len, kept)) == 9  # read as kept: nothing scanned
    monkeypatch.undo()
    for path, rows in zip(expand_pattern(pattern, ".tar"), kept, strict=True):
        assert shards.scan_shard(path) == rows

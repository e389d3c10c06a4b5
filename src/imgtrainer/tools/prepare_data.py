"""Split a folder of class folders into train/val, stratified per class.

    python src/prepare_data.py --source ~/Downloads/animals --output data --val_ratio 0.2

SOURCE/<class>/<images> (or one level deeper) becomes OUTPUT/{train,val}/. Each class is split on
its own, in an order drawn from (--seed, class name): the same seed gives the same split, and
adding a class moves no other file. Files are copied (--link: linked), or packed as Parquet or
tar shards (--format); non-images are counted, unreadable images left out.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from imgtrainer.data.layouts.image_files import (
    IMAGE_EXTENSIONS,
    class_folders,
    is_hidden_folder_name,
    is_image_file,
    walk_once,
    write_unreadable_list,
)
from imgtrainer.errors import UserError, exit_on_user_error
from imgtrainer.tools.pack_data import (
    FORMATS,
    default_workers,
    readable_images,
    write_parquet,
    write_shards,
)

SPLITS = ("train", "val")


STAGING = ".prepare_data.partial"


@dataclass
class ClassSplit:
    name: str
    train: list[Path] = field(default_factory=list)  # paths relative to the class folder
    val: list[Path] = field(default_factory=list)
    not_images: int = 0

    @property
    def images(self) -> int:
        return len(self.train) + len(self.val)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_data.py",
        description="Split SOURCE/<class>/<images> into OUTPUT/train and OUTPUT/val, per class.",
    )
    parser.add_argument(
        "--source",
        type=Path,
        required=True,
        help="folder of class folders (or a folder holding one such folder)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("data"),
        help="writes OUTPUT/train and OUTPUT/val (default: data)",
    )
    parser.add_argument(
        "--val_ratio", type=float, default=0.2, help="share of each class put in val (default: 0.2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (default: 0)")
    parser.add_argument(
        "--link", action="store_true", help="symlink the files instead of copying them"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="folder",
        help="folder (class folders, the default), parquet (the Hugging Face Hub's layout) or "
        "shards (WebDataset tar shards)",
    )
    parser.add_argument(
        "--shard_size",
        type=int,
        default=10000,
        help="images per Parquet file or tar shard (default: 10000)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUTPUT/train and OUTPUT/val if they are not empty",
    )
    return parser


# ----------------------------------------------------------------------------- finding classes


def find_class_root(source: Path) -> Path:
    """The folder whose subfolders are the classes: ``source`` itself, or its only subfolder when
    a download nests the classes one level deeper (animals/animals/<class>)."""
    if not source.is_dir():
        raise UserError(f"--source {source} does not exist or is not a folder")
    subfolders = class_folders(source)
    if any(_has_direct_images(folder) for folder in subfolders):
        return source
    # Only folders holding images count: a zip made on a Mac adds __MACOSX/ full of "._" files.
    with_images = [folder for folder in subfolders if _holds_images(folder)]
    if len(with_images) == 1 and any(_has_direct_images(f) for f in class_folders(with_images[0])):
        return with_images[0]
    raise UserError(
        f"--source {source} holds no class folders with images; expected "
        f"{source}/<class>/<image files> ({'/'.join(IMAGE_EXTENSIONS)})"
    )


def _has_direct_images(folder: Path) -> bool:
    return any(p.is_file() and is_image_file(p) for p in folder.iterdir())


def _holds_images(folder: Path) -> bool:
    return any(is_image_file(name) for _, _, names in os.walk(folder) for name in names)


def warn_line(line: str) -> None:
    print(f"WARNING: {line}", file=sys.stderr)


def list_class_files(class_folder: Path) -> tuple[list[Path], int]:
    """Image files under a class folder (relative, sorted: independent of the file system's
    listing order) and the number of other files, which are left out."""
    images, others = [], 0
    for dirpath, dirnames, names in walk_once(class_folder, warn_line):
        dirnames[:] = [d for d in dirnames if not is_hidden_folder_name(d)]
        for name in names:
            path = Path(dirpath, name)
            if not path.is_file():
                continue
            if is_image_file(name):
                images.append(path.relative_to(class_folder))
            else:
                others += 1
    return sorted(images), others


# ----------------------------------------------------------------------------- splitting


def val_count(images: int, val_ratio: float) -> int:
    """Images of a class put in val: the ratio rounded half up, at least one on each side when
    the class has two images or more."""
    if images < 2:
        return 0
    return min(images - 1, max(1, math.floor(images * val_ratio + 0.5)))


def too_few_to_split(images: int, val_ratio: float) -> bool:
    """The exact ratio would leave one side of this class empty."""
    wanted_val = math.floor(images * val_ratio + 0.5)
    return images < 2 or wanted_val == 0 or wanted_val == images


def split_class(name: str, images: list[Path], val_ratio: float, seed: int) -> ClassSplit:
    """Shuffle with a generator seeded by (seed, class name) -- Python seeds from a string through
    SHA-512, the same on every machine -- and cut the first ``val_count`` for val."""
    order = list(images)
    random.Random(f"{seed}/{name}").shuffle(order)
    cut = val_count(len(order), val_ratio)
    return ClassSplit(name, train=sorted(order[cut:]), val=sorted(order[:cut]))


def plan_split(root: Path, val_ratio: float, seed: int) -> list[ClassSplit]:
    plan = []
    for folder in class_folders(root):
        images, others = list_class_files(folder)
        split = split_class(folder.name, images, val_ratio, seed)
        split.not_images = others
        plan.append(split)
    return plan


# ----------------------------------------------------------------------------- writing


def check_output(output: Path, root: Path, force: bool) -> None:
    """Refuse to mix a new split with an old one, and never let --force delete the source."""
    source = root.resolve()
    for split in SPLITS:
        target = (output / split).resolve()
        if target == source or source in target.parents or target in source.parents:
            raise UserError(
                f"--output {output} and --source {root} overlap: "
                f"{output / split} would contain or replace the source images"
            )
    busy = [
        output / s
        for s in SPLITS
        if (output / s).exists() and (not (output / s).is_dir() or any((output / s).iterdir()))
    ]
    if busy and not force:
        raise UserError(
            f"{busy[0]} is not empty; pass --force to replace {output / 'train'} and "
            f"{output / 'val'} (nothing else in {output} is touched), or choose "
            "another --output"
        )


def write_split(plan: list[ClassSplit], root: Path, output: Path, link: bool) -> None:
    """Write into a staging folder, then swap it in: an interrupted run leaves the previous
    train/val folders as they were (and a staging folder that the next run replaces)."""
    staging = output / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    for split in plan:
        for name, files in (("train", split.train), ("val", split.val)):
            for relative in files:
                place_file(
                    root / split.name / relative, staging / name / split.name / relative, link
                )
    swap_in(staging, output)


def write_packed(
    plan: list[ClassSplit], root: Path, output: Path, args: argparse.Namespace
) -> dict[str, str]:
    """The split as Parquet files or tar shards (``args.format``), in the trainer's folder order
    (classes by name, then files), images that do not decode left out with one warning (the
    list in OUTPUT); staged and swapped in like a folder. Returns what to train on per split."""
    workers = default_workers()
    files = [root / s.name / rel for s in plan for name in SPLITS for rel in getattr(s, name)]
    _, unreadable = readable_images([(path, 0) for path in files], workers)
    if unreadable:
        listed = write_unreadable_list(unreadable, output)
        print(
            f"WARNING: {len(unreadable)} of {len(files)} image files cannot be decoded and are "
            f"left out (list in {listed})",
            file=sys.stderr,
        )
    for s in plan:  # the counts of the summary are then those written
        s.train = [rel for rel in s.train if str(root / s.name / rel) not in unreadable]
        s.val = [rel for rel in s.val if str(root / s.name / rel) not in unreadable]
    names = [s.name for s in plan]
    entries = {
        name: [(root / s.name / rel, n) for n, s in enumerate(plan) for rel in getattr(s, name)]
        for name in SPLITS
    }
    staging = output / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    write = write_parquet if args.format == "parquet" else write_shards
    specs = {
        name: write(entries[name], names, staging / name, args.shard_size, workers)
        for name in SPLITS
    }
    swap_in(staging, output)
    return {
        name: str(output / name / spec) if spec else str(output / name)
        for name, spec in specs.items()
    }


def swap_in(staging: Path, output: Path) -> None:
    for name in SPLITS:
        (staging / name).mkdir(parents=True, exist_ok=True)
        target = output / name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        os.replace(staging / name, target)
    staging.rmdir()


def place_file(source: Path, destination: Path, link: bool) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    if link:
        # An absolute target: the link works from any working directory.
        destination.symlink_to(source.resolve())
    else:
        shutil.copy2(source, destination)


def summary(
    plan: list[ClassSplit],
    root: Path,
    output: Path,
    args: argparse.Namespace,
    specs: dict[str, str] | None = None,
) -> str:
    specs = specs or {name: str(output / name) for name in SPLITS}
    used = [s for s in plan if s.images]
    how = "Linked" if args.link else "Copied"
    how = how if args.format == "folder" else f"Wrote ({args.format})"
    smallest = min(used, key=lambda s: (s.images, s.name))
    lines = [
        f"{how} {sum(s.images for s in plan)} images of "
        f"{len(used)} classes from {root} (val_ratio {args.val_ratio}, seed {args.seed}):",
        f"  train: {sum(len(s.train) for s in plan):>6} images in {output / 'train'}",
        f"  val:   {sum(len(s.val) for s in plan):>6} images in {output / 'val'}",
        f"  smallest class: {smallest.name} ({smallest.images} images: {len(smallest.train)} "
        f"train / {len(smallest.val)} val)",
        f"  left out: {sum(s.not_images for s in plan)} files that are not images",
        f"Train with: python launch_ddp.py --train_data {shlex.quote(specs['train'])} "
        f"--val_data {shlex.quote(specs['val'])}",
    ]
    return "\n".join(lines)


def warnings_for(plan: list[ClassSplit], val_ratio: float) -> list[str]:
    warnings = []
    empty = [s.name for s in plan if not s.images]
    if empty:
        warnings.append(f"WARNING: class folders without images, left out: {', '.join(empty)}")
    few = [s for s in plan if s.images and too_few_to_split(s.images, val_ratio)]
    if few:
        listed = ", ".join(
            f"{s.name} ({s.images}: {len(s.train)} train / {len(s.val)} val)" for s in few
        )
        advice = (
            "; training needs every class in val: add images or remove the folder"
            if any(not s.val for s in few)
            else ""
        )
        warnings.append(
            f"WARNING: too few images to split at --val_ratio {val_ratio}: {listed}{advice}"
        )
    return warnings


@exit_on_user_error
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0.0 < args.val_ratio < 1.0:
        raise UserError(f"--val_ratio must be between 0 and 1 (exclusive), got {args.val_ratio}")
    root = find_class_root(args.source)
    plan = plan_split(root, args.val_ratio, args.seed)
    check_output(args.output, root, args.force)
    for warning in warnings_for(plan, args.val_ratio):
        print(warning, file=sys.stderr)
    if args.shard_size < 1:
        raise UserError(f"--shard_size must be at least 1, got {args.shard_size}")
    used = [s for s in plan if s.images]
    specs = None
    if args.format == "folder":
        write_split(used, root, args.output, args.link)
    else:
        specs = write_packed(used, root, args.output, args)
    print(summary(plan, root, args.output, args, specs))
    return 0

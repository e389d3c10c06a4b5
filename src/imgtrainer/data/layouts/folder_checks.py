"""Checks of class folders, without decoding an image; each problem is one ``UserError`` line.

The classes of a folder, the same classes in training and validation, classes without images.
"""

from __future__ import annotations

from pathlib import Path

from imgtrainer.data.layouts.image_files import (
    IMAGE_EXTENSIONS,
    class_folders,
    is_image_file,
    walk_once,
)
from imgtrainer.errors import UserError

SHOWN_CLASSES = 5  # class names listed a side when two class lists differ


def find_classes(folder: Path, role: str) -> list[str]:
    """Class folder names of an ImageFolder (hidden folders and __MACOSX are never classes), or
    one clear error."""
    if not folder.is_dir():
        raise UserError(f"{role} folder {folder} does not exist")
    classes = [p.name for p in class_folders(folder)]
    if not classes:
        raise UserError(
            f"{role} folder {folder} has no class folders; expected {folder}/<class>/<image files>"
        )
    return classes


def check_data_folders(train_dir: Path, val_dir: Path) -> list[str]:
    """The class names shared by both folders; any problem is one line naming the fix (a class
    folder without an image file too: found before a run builds anything)."""
    if not train_dir.exists() and not val_dir.exists():
        raise UserError(
            f"no dataset found: looked for {train_dir.resolve()} and {val_dir.resolve()}. "
            "Try the bundled demo with `python launch_ddp.py --demo`, or put your images in "
            f"{train_dir}/<class>/*.jpg and {val_dir}/<class>/*.jpg "
            "(or point --train_dir/--val_dir at them)"
        )
    train_classes = find_classes(train_dir, "training")
    val_classes = find_classes(val_dir, "validation")
    if train_classes != val_classes:
        raise UserError(
            f"the class folders of {train_dir} and {val_dir} differ: "
            + class_difference(train_classes, val_classes, ("training", "validation"))
        )
    for folder, role in ((train_dir, "training"), (val_dir, "validation")):
        counts = count_images(folder, train_classes, enough=0)
        refuse_empty_classes(folder, [name for name, n in counts.items() if n == 0], role)
    return train_classes


def class_difference(first: list[str], second: list[str], names: tuple[str, str]) -> str:
    """``only in FIRST: [...]; only in SECOND: [...]`` ('none' for an empty side), at most
    ``SHOWN_CLASSES`` names a side: how two class lists differ, for an error line."""
    sides = []
    for name, mine, other in ((names[0], first, second), (names[1], second, first)):
        only = sorted(set(mine) - set(other))
        more = f" and {len(only) - SHOWN_CLASSES} more" if len(only) > SHOWN_CLASSES else ""
        sides.append(f"only in {name}: {only[:SHOWN_CLASSES] or 'none'}{more}")
    return "; ".join(sides)


def image_files_in(folder: Path):
    """The image files (by extension) under ``folder``, walked the way torchvision's
    ImageFolder walks it (recursively, following links, each folder once), as they are found."""
    for _, _, files in walk_once(folder):
        yield from (file for file in files if is_image_file(file))


def count_images(folder: Path, classes: list[str], enough: int | None = None) -> dict[str, int]:
    """Image files under each class folder: at least one where there is one, and in all at
    least ``enough`` where there are that many (None: every file). The launcher's checks stop
    there, so they take a moment whatever the number of images; the ranks list them all."""
    counts = {}
    needed = enough
    for name in classes:
        counts[name] = 0
        for _ in image_files_in(folder / name):
            counts[name] += 1
            if needed is not None and counts[name] >= max(1, needed):
                break
        if needed is not None:
            needed -= counts[name]
    return counts


def refuse_empty_classes(
    folder: Path | str, empty: list[str], role: str, readable: bool = False
) -> None:
    """One error naming the class folders left without images (``readable``: once the files
    that do not decode are left out)."""
    if not empty:
        return
    extensions = "/".join(IMAGE_EXTENSIONS)
    what = (
        f"readable image ({extensions} files that decode)"
        if readable
        else f"image files ({extensions})"
    )
    if not Path(folder).is_dir():  # a list file, Parquet, shards
        raise UserError(f"{role} data {folder}: class(es) {', '.join(empty)} hold no {what}")
    raise UserError(
        f"{role} folder {folder}: class folder(s) {', '.join(empty)} hold no {what}; "
        "add images or remove the folder"
    )

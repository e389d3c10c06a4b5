#!/usr/bin/env python
"""Build a small natural-image classification set offline, from photographs that Debian and the
project's Python packages ship, to measure training recipes on real photos (bench/recipes/recipes.py).

    apt-get install mate-backgrounds lomiri-wallpapers-16.04        # the photographs (62 MB)
    python bench/recipes/natural_data.py data/photos                # -> data/photos/{train,val}
    python bench/recipes/natural_data.py data/photos --seed 1 --force  # another draw of the crops

Each class is one photograph (28 of them: flowers, leaves, insects, mountains, a beach, a bridge,
a wine glass, a temple, a portrait, ...; ``PHOTOS`` lists them and the package that ships each).
The photo is cut along its long side into a training part (60%) and a validation part (35%), with
a 5% gap between them, and which end is validation is drawn per class. Training images are square
crops from the training part, validation images from the validation part, at sizes drawn between
``--min_crop`` and ``--max_crop`` of the part's short side, each written as an ``--size`` px JPEG.
No validation pixel is ever seen in training, so the task needs generalisation across the scene
(another patch of the same meadow, the other half of a face), not memorisation; the small number
of images per class makes regularisation and augmentation matter, as on Animals-90.

Everything follows from ``--seed``: the same seed writes the same files. The sources are not
downloaded: a missing one is one ``error:`` line naming the package to install (exit code 2).
No test needs this script; it is a benchmark tool.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from imgtrainer.errors import UserError, exit_on_user_error  # noqa: E402

MATE = "/usr/share/backgrounds/mate/nature"
LOMIRI = "/usr/share/backgrounds"
WORKING_SIDE = 1280  # photos are first shrunk so their long side is at most this (speed)
TRAIN_SHARE, GAP_SHARE = 0.60, 0.05  # of the long side; the validation part is the rest


@dataclass(frozen=True)
class Photo:
    name: str  # the class name
    where: str  # "apt:PACKAGE:/abs/path" or "py:PACKAGE:how to find it"


PHOTOS: list[Photo] = [
    *(
        Photo(name.lower(), f"apt:mate-backgrounds:{MATE}/{name}.jpg")
        for name in (
            "Aqua",
            "Blinds",
            "Dune",
            "FreshFlower",
            "Garden",
            "GreenMeadow",
            "LadyBird",
            "RainDrops",
            "Storm",
            "TwoWings",
            "Wood",
            "YellowFlower",
        )
    ),
    *(
        Photo(file.split("_by_")[0].lower(), f"apt:lomiri-wallpapers-16.04:{LOMIRI}/{file}")
        for file in (
            "Bridge_by_Sander_Klootwijk.jpg",
            "Dragonfly_by_Bolly.jpg",
            "Picture_0B_by_freespace.jpg",
            "Picture_1A_by_freespace.jpg",
            "Wine_by_Jakkub_Mede.jpg",
            "aitzgorri_by_Aitzol_Berasategi.jpg",
            "free_by_Peter_Nerlich.jpg",
            "friends_by_Aitzol_Berasategi.jpg",
            "greentock_by_Peter_Nerlich.jpg",
            "life_by_Aitzol_Berasategi.jpg",
            "picosdeeuropa_by_Aitzol_Berasategi.jpg",
            "seeding_by_Clements_Engelhardt.jpg",
            "sunset_by_Aitzol_Berasategi.jpg",
        )
    ),
    Photo("china", "py:scikit-learn:sklearn.datasets/images/china.jpg"),
    Photo("flower", "py:scikit-learn:sklearn.datasets/images/flower.jpg"),
    Photo("grace_hopper", "py:matplotlib:matplotlib/mpl-data/sample_data/grace_hopper.jpg"),
]


def source_path(photo: Photo) -> Path:
    """Where the photo lies on this machine, or a UserError naming the package to install."""
    kind, package, rest = photo.where.split(":", 2)
    if kind == "apt":
        path, install = Path(rest), f"apt-get install {package}"
    else:
        install = f"pip install {package}"
        try:
            if package == "matplotlib":
                import matplotlib

                path = Path(matplotlib.get_data_path()) / "sample_data" / Path(rest).name
            else:
                import sklearn.datasets

                path = Path(sklearn.datasets.__file__).parent / "images" / Path(rest).name
        except ImportError:
            raise UserError(f"photo {photo.name!r} comes with {package}: {install}") from None
    if not path.is_file():
        raise UserError(f"{path} not found (photo {photo.name!r}): {install}")
    return path


def load_photo(path: Path) -> Image.Image:
    image = Image.open(path)
    image.draft("RGB", (WORKING_SIDE, WORKING_SIDE))  # JPEG: decode at a reduced scale, fast
    image = image.convert("RGB")
    scale = WORKING_SIDE / max(image.size)
    if scale < 1:
        image = image.resize(
            (round(image.width * scale), round(image.height * scale)), Image.Resampling.LANCZOS
        )
    return image


def split_boxes(
    size: tuple[int, int], val_first: bool
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """(train box, val box) as (left, top, right, bottom): the photo cut along its long side."""
    width, height = size
    long_side = max(width, height)
    train_len = round(long_side * TRAIN_SHARE)
    val_start = round(long_side * (TRAIN_SHARE + GAP_SHARE))
    spans = [(0, train_len), (val_start, long_side)]
    if val_first:  # mirror: validation at the start of the long side, training at the end
        spans = [(long_side - b, long_side - a) for a, b in spans]
    boxes = []
    for a, b in spans:
        boxes.append((a, 0, b, height) if width >= height else (0, a, width, b))
    return boxes[0], boxes[1]


def random_crops(
    image: Image.Image,
    box: tuple[int, int, int, int],
    count: int,
    rng: random.Random,
    min_crop: float,
    max_crop: float,
    size: int,
) -> list[Image.Image]:
    """``count`` square crops inside ``box``, sides drawn from [min_crop, max_crop] x short side."""
    left, top, right, bottom = box
    short = min(right - left, bottom - top)
    crops = []
    for _ in range(count):
        side = max(8, round(short * rng.uniform(min_crop, max_crop)))
        x = rng.randint(left, right - side)
        y = rng.randint(top, bottom - side)
        crop = image.crop((x, y, x + side, y + side))
        crops.append(crop.resize((size, size), Image.Resampling.BICUBIC))
    return crops


def build(args: argparse.Namespace) -> None:
    output: Path = args.output
    if output.exists() and not output.is_dir():
        raise UserError(f"{output} is a file; give a folder")
    if output.is_dir() and any(output.iterdir()):
        if not args.force:
            raise UserError(f"{output} is not empty; add --force to replace it")
        for split in ("train", "val"):
            shutil.rmtree(output / split, ignore_errors=True)
    sources = {photo.name: source_path(photo) for photo in PHOTOS}  # every check before writing
    photos = PHOTOS[: args.classes]
    lines = []
    for photo in photos:
        rng = random.Random(f"{args.seed}:{photo.name}")  # per class: one class never moves another
        image = load_photo(sources[photo.name])
        val_first = rng.random() < 0.5
        train_box, val_box = split_boxes(image.size, val_first)
        for split, box, count in (
            ("train", train_box, args.train_per_class),
            ("val", val_box, args.val_per_class),
        ):
            folder = output / split / photo.name
            folder.mkdir(parents=True, exist_ok=True)
            crops = random_crops(image, box, count, rng, args.min_crop, args.max_crop, args.size)
            for i, crop in enumerate(crops):
                crop.save(folder / f"{photo.name}_{i:03d}.jpg", quality=90)
        lines.append(
            f"{photo.name}\t{sources[photo.name]}\ttrain box {train_box}\tval box {val_box}"
        )
    (output / "SOURCES.txt").write_text(
        f"# bench/recipes/natural_data.py --seed {args.seed} --size {args.size} "
        f"--train_per_class {args.train_per_class} --val_per_class {args.val_per_class} "
        f"--min_crop {args.min_crop} --max_crop {args.max_crop}\n"
        f"# boxes in pixels of the photo shrunk to a long side of {WORKING_SIDE}\n"
        + "\n".join(lines)
        + "\n"
    )
    print(
        f"{output}: {len(photos)} classes, {len(photos) * args.train_per_class} train and "
        f"{len(photos) * args.val_per_class} val images of {args.size} px (seed {args.seed})"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="natural_data.py", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    parser.add_argument("output", type=Path, help="writes OUTPUT/train and OUTPUT/val")
    parser.add_argument("--seed", type=int, default=0, help="seed of every crop (default: 0)")
    parser.add_argument(
        "--classes", type=int, default=len(PHOTOS), help=f"first N photos (default: {len(PHOTOS)})"
    )
    parser.add_argument("--train_per_class", type=int, default=32, help="default: 32")
    parser.add_argument("--val_per_class", type=int, default=20, help="default: 20")
    parser.add_argument(
        "--size", type=int, default=80, help="side of each JPEG in px (default: 80)"
    )
    parser.add_argument(
        "--min_crop", type=float, default=0.2, help="smallest crop side / part's short side"
    )
    parser.add_argument(
        "--max_crop", type=float, default=0.6, help="largest crop side / part's short side"
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUTPUT")
    args = parser.parse_args(argv)
    if not 1 <= args.classes <= len(PHOTOS):
        raise UserError(f"--classes must be between 1 and {len(PHOTOS)}, got {args.classes}")
    if not 0 < args.min_crop <= args.max_crop <= 1:
        raise UserError("need 0 < --min_crop <= --max_crop <= 1")
    if args.train_per_class < 1 or args.val_per_class < 1 or args.size < 8:
        raise UserError("--train_per_class and --val_per_class must be >= 1, --size >= 8")
    return args


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    build(parse_args(argv))


if __name__ == "__main__":
    main()

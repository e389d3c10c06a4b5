"""One image file read robustly, and the decode check of one image.

Which files count as images, decoding to upright RGB, which JPEGs the device decodes as they
are. No torch here: ``src/prepare_data.py`` imports this module and starts in a fraction of a
second.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

from PIL import Image, ImageOps

from imgtrainer.errors import first_line
from imgtrainer.files import atomic_write
from imgtrainer.process import process_map

log = logging.getLogger(__name__)

# The extensions torchvision's ImageFolder accepts (``datasets.folder.IMG_EXTENSIONS``), repeated
# so this module needs no torch import; a test checks that the two stay equal.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


UNREADABLE_LIST = "unreadable_images.txt"


# The check decodes at a reduced scale (JPEG's DCT scaling): every byte of the file is still read
# and entropy-decoded, so truncated and corrupt files fail, at a fraction of the full cost.
CHECK_DRAFT_SIZE = 1  # the smallest scale JPEG decoding offers: 1/8


# Below this many files, a pool of threads is not worth starting.
PARALLEL_MIN_FILES = 256


# Folders that are never classes, in training, evaluation, prediction and preparation alike:
# hidden ones (.git, .ipynb_checkpoints, .Trash) and the __MACOSX folder that a zip made on a Mac
# carries next to the real folders, full of "._" resource forks that are not images.
NOT_CLASS_FOLDERS = frozenset({"__MACOSX"})


def is_hidden_folder_name(name: str) -> bool:
    """A folder name that never holds a class or user images (see ``NOT_CLASS_FOLDERS``)."""
    return name.startswith(".") or name in NOT_CLASS_FOLDERS


def walk_once(
    folder: str | Path, warn: Callable[[str], None] | None = None
) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` following links, as torchvision's ImageFolder walks, but each folder once: a
    folder reached again through a link (``ln -s . again`` makes a cycle that repeats every image
    it holds) is skipped, with one warning (``warn``, the log's by default)."""
    seen: set[tuple[int, int]] = set()
    for where, folders, files in os.walk(folder, followlinks=True):
        try:
            status = os.stat(where)
        except OSError:  # gone while walked
            continue
        if (status.st_dev, status.st_ino) in seen:
            folders[:] = []
            (warn or log.warning)(f"{where} is a folder already read (through a link): skipped")
            continue
        seen.add((status.st_dev, status.st_ino))
        yield where, folders, files


def images_under(folder: Path, warn: Callable[[str], None] | None = None) -> list[Path]:
    """The image files under ``folder`` (``walk_once``; hidden folders left out), sorted."""
    found = []
    for where, folders, names in walk_once(folder, warn):
        folders[:] = [name for name in folders if not is_hidden_folder_name(name)]
        found += [Path(where, n) for n in names if is_image_file(n) and Path(where, n).is_file()]
    return sorted(found)


def class_folders(root: Path) -> list[Path]:
    """The class folders of an ImageFolder root, sorted by name: every visible subfolder."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not is_hidden_folder_name(p.name))


def is_image_file(path: str | Path) -> bool:
    """An image by its extension (any case). Hidden files are not: macOS leaves ``._photo.jpg``
    resource forks next to the real photos, and they do not decode."""
    name = os.path.basename(path)
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def open_rgb(path: str | Path | IO[bytes], draft: int | None = None) -> Image.Image:
    """The image at ``path`` (or in a file object) as RGB, turned upright according to its EXIF orientation.

    Cameras store portrait photos sideways with an orientation tag; without honouring it the
    model would train on rotated animals. ``draft`` lets JPEGs decode at a reduced scale.
    """
    with Image.open(path) as image:
        if draft:
            image.draft("RGB", (draft, draft))
        # exif_transpose returns a loaded copy (transposed if needed): the file can be closed.
        upright = ImageOps.exif_transpose(image)
    return to_rgb(upright)


EXIF_ORIENTATION = 0x0112


def nvjpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a JPEG whose GPU decoding (nvjpeg, RGB) gives ``open_rgb``'s picture,
    read from the header alone; None for anything else, which is decoded on the CPU: other
    formats, grayscale and CMYK (``open_rgb`` converts them with PIL's rules), progressive
    JPEGs, RGB stored untransformed (Adobe marker), and photos with an EXIF orientation
    (``open_rgb`` turns them upright, nvjpeg does not)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "JPEG" or image.mode != "RGB" or "progressive" in image.info:
                return None
            if image.info.get("adobe_transform", 1) == 0:  # RGB stored as such, not YCbCr
                return None
            if image.getexif().get(EXIF_ORIENTATION, 1) != 1:
                return None
            return image.height, image.width
    except Exception:  # not an image PIL knows, or a damaged header: the CPU path reports it
        return None


def to_rgb(image: Image.Image) -> Image.Image:
    """Grayscale, palette, CMYK, RGBA... to RGB. Transparent pixels become white: the colour under
    a transparent pixel is arbitrary (often black), while cut-out objects are meant on white."""
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        image.mode == "P" and "transparency" in image.info
    )
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGB", rgba.size, (255, 255, 255))
    background.paste(rgba, mask=rgba.getchannel("A"))
    return background


def image_problem(image: str | Path | IO[bytes]) -> str | None:
    """None if ``image`` (a path, or the bytes as a file) decodes to an RGB image, otherwise why
    it does not (one line): the decode check of one image."""
    try:
        open_rgb(image, draft=CHECK_DRAFT_SIZE)
    except Exception as err:  # any failure of a decoder on a user's file means "unreadable"
        return first_line(err)
    return None


def find_unreadable(
    paths: Sequence[str], workers: int = 1, problem: Callable[[str], str | None] | None = None
) -> dict[str, str]:
    """``{path: reason}`` for every file of ``paths`` that does not decode (``problem``: how
    one is checked, ``image_problem`` by default; a table's images are checked by location).

    Large lists are checked in ``workers`` forked processes, as the loader workers are: the
    check of a small image is mostly Python (Pillow's header parsing), which threads would run
    one at a time under the GIL. The children only decode files: no CUDA, no process group.
    """
    problem = problem or image_problem
    if workers > 1 and len(paths) >= PARALLEL_MIN_FILES:
        problems = process_map(problem, paths, workers, max(16, len(paths) // (8 * workers)))
    else:
        problems = [problem(path) for path in paths]
    return {
        path: problem for path, problem in zip(paths, problems, strict=True) if problem is not None
    }


def printable(name: str) -> str:
    """``name`` as it is, or escaped (``\\n``, ``\\udce9``) when it holds a control character or
    bytes that are not UTF-8: one line of a list, whatever a file or tar member is called."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def write_unreadable_list(unreadable: dict[str, str], folder: Path) -> Path:
    """Write ``folder/unreadable_images.txt`` (one ``path<TAB>reason`` line per file).

    Every process of a distributed run writes the same content, each to its own temporary file
    renamed into place: whichever rename lands last, the file is complete and correct.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / UNREADABLE_LIST
    lines = (f"{printable(p)}\t{reason}\n" for p, reason in sorted(unreadable.items()))
    text = "".join(lines).encode(errors="backslashreplace")
    atomic_write(path, lambda f: f.write(text), lambda: len(text))
    return path

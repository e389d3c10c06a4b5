"""What the tests and the benchmarks share: generated ImageFolders, and the launcher (or any
command-line tool) run in a new interpreter, the way a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "launch_ddp.py"

# Distinct colours for the first classes: a trivially separable problem a tiny run can learn.
COLOURS = [(220, 30, 30), (30, 200, 40), (40, 60, 220), (230, 220, 40), (200, 40, 200)]


def class_colour(index: int) -> tuple[int, int, int]:
    if index < len(COLOURS):
        return COLOURS[index]
    return ((index * 97 + 40) % 256, (index * 57 + 90) % 256, (index * 23 + 160) % 256)


def class_names(count: int) -> list[str]:
    """``class_00``, ``class_01``, ...: zero-padded so that they sort in index order."""
    width = max(2, len(str(count - 1)))
    return [f"class_{k:0{width}d}" for k in range(count)]


def write_image_folder(
    root: Path,
    classes: Sequence[str] | int,
    per_class: int,
    size: int = 16,
    seed: int = 0,
    ext: str = "jpg",
    *,
    noise: float = 25.0,
    coloured: bool = True,
    quality: int | None = None,
    threads: int = 1,
) -> Path:
    """``root/<class>/img_<i>.<ext>``: ``per_class`` images of ``size`` px for each of ``classes``
    (names, or a count: ``class_names``). Each image is Gaussian noise of std ``noise`` around
    its class's colour, or, not ``coloured``, uniform random pixels that tell no class apart.
    The same arguments write the same pixels; ``threads`` encode the files in parallel;
    ``quality``: JPEG quality (PIL's default without it)."""
    rng = np.random.default_rng(seed)
    names = class_names(classes) if isinstance(classes, int) else list(classes)
    options = {} if quality is None else {"quality": quality}

    def save(job: tuple[Path, np.ndarray]) -> None:
        Image.fromarray(job[1]).save(job[0], **options)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for c, name in enumerate(names):
            folder = root / name
            folder.mkdir(parents=True, exist_ok=True)
            base = np.array(class_colour(c), dtype=np.float32)
            jobs = []
            for i in range(per_class):
                if coloured:
                    pixels = np.clip(base + rng.normal(0, noise, (size, size, 3)), 0, 255)
                    pixels = pixels.astype(np.uint8)
                else:
                    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                jobs.append((folder / f"img_{i:03d}.{ext}", pixels))
            list(pool.map(save, jobs))
    return root


# Photo shapes as width / height, cycled over each class's images: both orientations, 16:9 too.
PHOTO_ASPECTS = (4 / 3, 3 / 4, 16 / 9, 9 / 16, 3 / 2, 2 / 3, 1.0)
PANORAMA_ASPECT = 4.0
TEXTURE_SIDE = 1024  # the side of the few textures every photo is cut from
SHAPES_PER_TEXTURE = 60


def photo_textures(rng: np.random.Generator, count: int = 4) -> list[Image.Image]:
    """``count`` photo-like RGB textures: smooth shapes at several scales (each octave a small
    random array upscaled bicubically) plus fine grain, so JPEG files and their decoding cost
    what camera photos do, unlike flat or pure-noise patches."""
    textures = []
    for _ in range(count):
        total = np.zeros((TEXTURE_SIDE, TEXTURE_SIDE, 3), dtype=np.float32)
        for cells, amplitude in ((3, 70.0), (12, 40.0), (48, 22.0), (192, 12.0)):
            small = rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
            big = Image.fromarray(small).resize((TEXTURE_SIDE, TEXTURE_SIDE), Image.BICUBIC)
            total += (np.asarray(big, dtype=np.float32) - 128) * (amplitude / 128)
        smooth = Image.fromarray(np.clip(total + 128, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(smooth)
        for _ in range(SHAPES_PER_TEXTURE):  # objects: hard edges, as in real scenes
            x, y = rng.integers(0, TEXTURE_SIDE, 2)
            w, h = rng.integers(20, TEXTURE_SIDE // 4, 2)
            colour = tuple(int(v) for v in rng.integers(0, 256, 3))
            shape = draw.ellipse if rng.integers(0, 2) else draw.rectangle
            shape((int(x), int(y), int(x + w), int(y + h)), fill=colour)
        grain = rng.normal(0, 5, total.shape).astype(np.float32)
        pixels = np.asarray(smooth, dtype=np.float32) + grain
        textures.append(Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)))
    return textures


# Phone cameras' photos (width, height): 12 MP (4032 x 3024) and 24 MP (6000 x 4000).
PHONE_SIZES = ((4032, 3024), (6000, 4000))


def photo_size(index: int, short_side: int, rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) of a class's ``index``-th photo: a PHOTO_ASPECTS shape in turn, its short
    side ``short_side`` to 1.25 x that."""
    aspect = PHOTO_ASPECTS[index % len(PHOTO_ASPECTS)]
    short = short_side + int(rng.integers(0, short_side // 4 + 1))
    if aspect >= 1:
        return round(short * aspect), short
    return short, round(short / aspect)


def cut_photo(
    texture: Image.Image, size: tuple[int, int], lut: list[int], rng: np.random.Generator
) -> Image.Image:
    """A ``size`` photo from a random part of ``texture`` (upscaled when larger than it), toned
    with ``lut`` (the class's colour cast)."""
    width, height = size
    scale = max(width / TEXTURE_SIDE, height / TEXTURE_SIDE, 1.0)
    w, h = min(TEXTURE_SIDE, round(width / scale)), min(TEXTURE_SIDE, round(height / scale))
    left = int(rng.integers(0, TEXTURE_SIDE - w + 1))
    top = int(rng.integers(0, TEXTURE_SIDE - h + 1))
    photo = texture.crop((left, top, left + w, top + h))
    if (w, h) != size:
        photo = photo.resize(size, Image.BICUBIC)
    if rng.integers(0, 2):
        photo = photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return photo.point(lut)


def class_lut(index: int) -> list[int]:
    """A colour cast toward the class's colour (a third of the way): learnable, photo-like."""
    return [round(v * 2 / 3 + c / 3) for c in class_colour(index) for v in range(256)]


def write_photo_folder(
    root: Path,
    classes: Sequence[str] | int,
    per_class: int,
    short_side: int = 500,
    seed: int = 0,
    *,
    panorama: bool = True,
    quality: int = 85,
    threads: int = 1,
    phones: int = 0,
) -> Path:
    """``root/<class>/img_<i>.jpg``: ``per_class`` photo-like JPEGs per class of mixed aspect
    (PHOTO_ASPECTS: 4:3, 3:2, 16:9 and square, both orientations; short side ``short_side`` to
    1.25 x that) and, with ``panorama``, the first class's first image a 4:1 panorama: the
    shapes that make image caches and crops larger than square bench patches do. With
    ``phones``, every ``phones``-th photo of a class is a phone camera's (PHONE_SIZES: 12 and
    24 MP, both orientations), the decoded sizes the memory bounds must meet. Cut from a few
    textures drawn once per call (``photo_textures``), toned per class; ``threads`` cut and
    encode in parallel. The same arguments write the same files."""
    rng = np.random.default_rng(seed)
    textures = photo_textures(rng)
    names = class_names(classes) if isinstance(classes, int) else list(classes)
    jobs = []
    for c, name in enumerate(names):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            size = photo_size(i, short_side, rng)
            if panorama and c == 0 and i == 0:
                size = (round(short_side * PANORAMA_ASPECT), short_side)
            elif phones and i % phones == phones - 1:
                width, height = PHONE_SIZES[(i // phones) % len(PHONE_SIZES)]
                size = (width, height) if (i // phones) % 4 < 2 else (height, width)
            path = root / name / f"img_{i:03d}.jpg"
            jobs.append(
                (path, textures[int(rng.integers(len(textures)))], size, c, rng.spawn(1)[0])
            )

    def save(job) -> None:
        path, texture, size, c, job_rng = job
        cut_photo(texture, size, class_lut(c), job_rng).save(path, quality=quality)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(save, jobs))
    return root


def write_split_folder(
    root: Path,
    classes: int,
    train_per_class: int,
    val_per_class: int,
    side: int,
    *,
    photos: bool = False,
    noise: float = 30.0,
    threads: int | None = None,
    phones: int = 0,
) -> Path:
    """``root/{train,val}/class_NN/*.jpg`` (seeds 0 and 1): noisy square patches of ``side`` px,
    one colour per class, Gaussian noise of std ``noise``, JPEG quality 90; or with ``photos``
    photo-like JPEGs of mixed aspect, short side ``side`` px to 1.25 x that, one 4:1 panorama
    among the training images, and every ``phones``-th a phone's 12 or 24 MP photo
    (``write_photo_folder``). ``threads`` (default: one per core) encode in parallel."""
    threads = threads or os.cpu_count() or 1
    for split, per_class, seed in (("train", train_per_class, 0), ("val", val_per_class, 1)):
        if photos:
            panorama = split == "train"
            write_photo_folder(
                root / split, classes, per_class, side, seed,
                panorama=panorama, threads=threads, phones=phones,
            )  # fmt: skip
        else:
            write_image_folder(
                root / split, classes, per_class, side, seed, noise=noise, quality=90,
                threads=threads,
            )  # fmt: skip
    return root


# ----------------------------------------------------------------------------- new interpreters


def run_cli(
    args: Sequence, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """``python <args>`` run the way a user would, its output captured as text; ``env``:
    variables set on top of this process's environment."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        **kwargs,
    )


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``env`` on top, output unbuffered (read as it comes)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def launcher_command(*args: object) -> list[str]:
    """``python launch_ddp.py <args>``, as a user types it."""
    return [sys.executable, str(LAUNCHER), *map(str, args)]


def run_launcher(
    args: Sequence, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python launch_ddp.py <args>`` to its end (``run_cli``)."""
    return run_cli([LAUNCHER, *args], cwd, timeout, env)


def start_launcher(
    args: Sequence, cwd: Path, env: dict[str, str] | None = None, **kwargs
) -> subprocess.Popen:
    """``python launch_ddp.py <args>`` started in the background, its output captured as text
    (``kwargs`` override ``subprocess.Popen``'s arguments)."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
    return subprocess.Popen(launcher_command(*args), cwd=cwd, env=child_env(env), **options)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun, the ranks, their loader workers), from /proc;
    torchrun runs in its own session, so its process group does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

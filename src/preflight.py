"""Checks that need no torch: the data folders, flag combinations and the GPUs on this node.

The launcher runs them before it starts torchrun, so the commonest mistakes are one line within a
fraction of a second instead of after three imports of torch (launcher, agent, workers: seconds
each). The workers run the data-folder checks again (they may be started without the launcher),
and everything that needs torch or timm (the model name, decoding the images, the device itself,
loading a checkpoint) is checked there and reaches the console as one line through the launcher
(see ``outcome.py``).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from config import TrainConfig, optimizer_batch
from errors import UserError
from image_files import IMAGE_EXTENSIONS, class_folders, is_image_file

# ----------------------------------------------------------------------------- data folders


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
    """The class names shared by both folders; any problem is one line naming the fix."""
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
        only_train = sorted(set(train_classes) - set(val_classes))
        only_val = sorted(set(val_classes) - set(train_classes))
        raise UserError(
            f"the class folders of {train_dir} and {val_dir} differ: "
            f"missing in validation: {only_train or 'none'}; "
            f"missing in training: {only_val or 'none'}"
        )
    return train_classes


def count_images(folder: Path, classes: list[str]) -> dict[str, int]:
    """Image files (by extension) under each class folder, walked the way torchvision's
    ImageFolder walks it (recursively, following links)."""
    return {
        name: sum(
            is_image_file(file)
            for _, _, files in os.walk(folder / name, followlinks=True)
            for file in files
        )
        for name in classes
    }


def check_no_empty_class_folder(folder: Path, counts: dict[str, int], role: str) -> None:
    empty = [name for name, n in counts.items() if n == 0]
    if empty:
        raise UserError(
            f"{role} folder {folder}: class folder(s) {', '.join(empty)} hold no "
            f"image files ({'/'.join(IMAGE_EXTENSIONS)}); add images or remove the "
            "folder"
        )


# ----------------------------------------------------------------------------- flags


def check_device_options(cfg: TrainConfig, device_type: str) -> None:
    if device_type == "cuda":
        return
    if cfg.cache_images == "gpu":
        raise UserError("--cache_images gpu needs a CUDA device; use --cache_images ram")
    if cfg.sync_bn:
        raise UserError(
            "--sync_bn needs CUDA (SyncBatchNorm runs on GPUs only); drop it on the CPU"
        )


def check_batch_fits(train_images: int, cfg: TrainConfig, world_size: int) -> None:
    """Every process needs at least one full optimizer step's batch per epoch (the training
    loader yields --accum_steps batches of --batch_size as one, and drops a partial last one)."""
    if math.ceil(train_images / world_size) >= optimizer_batch(cfg):
        return
    if cfg.accum_steps == 1:
        asked, lower = f"--batch_size {cfg.batch_size}", "lower --batch_size"
    else:
        asked = (
            f"one optimizer step of --batch_size {cfg.batch_size} x --accum_steps "
            f"{cfg.accum_steps} = {optimizer_batch(cfg)} images"
        )
        lower = "lower --batch_size or --accum_steps"
    raise UserError(
        f"{cfg.train_dir} has {train_images} images: too few for {asked} on "
        f"{world_size} process(es); {lower}"
    )


def check_output_folders(cfg: TrainConfig) -> None:
    for flag, value in (("checkpoint_dir", cfg.checkpoint_dir), ("log_dir", cfg.log_dir)):
        path = Path(value)
        if path.exists() and not path.is_dir():
            raise UserError(f"--{flag} {path} is a file, not a folder; choose another --{flag}")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_file():
        raise UserError(f"--resume {cfg.resume}: no such file")


def launcher_checks(cfg: TrainConfig, device_type: str, world_size: int) -> None:
    """Everything about the input that can be checked without torch, in a fraction of a second.
    (The demo data is written by the workers: it needs no check.)"""
    check_output_folders(cfg)
    check_device_options(cfg, device_type)
    if cfg.demo:
        return
    classes = check_data_folders(Path(cfg.train_dir), Path(cfg.val_dir))
    train_counts = count_images(Path(cfg.train_dir), classes)
    check_no_empty_class_folder(Path(cfg.train_dir), train_counts, "training")
    check_no_empty_class_folder(
        Path(cfg.val_dir), count_images(Path(cfg.val_dir), classes), "validation"
    )
    check_batch_fits(sum(train_counts.values()), cfg, world_size)


# ----------------------------------------------------------------------------- GPUs


def visible_gpu_count() -> int:
    """The CUDA GPUs a process started from here would see, without importing torch.

    The NVIDIA driver creates one /dev/nvidiaN node per GPU, and a container gets the nodes of
    the GPUs it was given only; CUDA_VISIBLE_DEVICES then narrows the list (CUDA reads it up to
    the first entry it cannot use; empty or "-1" hides every GPU). This is a count, not a proof
    that CUDA works: each worker still checks its device with torch and, if it has none, stops
    with one line through the launcher.
    """
    installed = sum(1 for name in _dev_entries() if re.fullmatch(r"nvidia\d+", name))
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return installed
    entries = 0
    for item in listed.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        entries += 1
    return min(entries, installed)


def _dev_entries() -> list[str]:
    try:
        return os.listdir("/dev")
    except OSError:
        return []

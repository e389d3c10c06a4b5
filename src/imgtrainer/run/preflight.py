"""Checks that need no torch (data folders, flag combinations, this node's GPUs), run by the
launcher before torchrun so the commonest mistakes are one line at once; the workers check the
data folders again and everything that needs torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from imgtrainer.data.checks import check_data_folders, check_no_empty_class_folder, count_images
from imgtrainer.errors import UserError
from imgtrainer.run.config import TrainConfig, optimizer_batch
from imgtrainer.run.folder import check_checkpoint_dir

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
    """An epoch needs at least one full optimizer step over all processes (the training
    loader yields --accum_steps batches of --batch_size as one; a partial last step is left
    out)."""
    if train_images >= optimizer_batch(cfg) * world_size:
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
    check_checkpoint_dir(Path(cfg.checkpoint_dir))
    log_dir = Path(cfg.log_dir)
    if log_dir.exists() and not log_dir.is_dir():
        raise UserError(f"--log_dir {log_dir} is a file, not a folder; choose another --log_dir")
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

# Set to 1, lets more processes than visible GPUs run, sharing them over gloo (NCCL refuses two
# ranks on one device). Only for the self-check (bench/gpu_check.py), so that the multi-process
# CUDA path runs on one-GPU machines; never faster than one process per GPU, so not a flag.
SHARE_GPUS_ENV = "IMGTRAINER_SHARE_GPUS"


def gpus_may_be_shared() -> bool:
    return os.environ.get(SHARE_GPUS_ENV) == "1"


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

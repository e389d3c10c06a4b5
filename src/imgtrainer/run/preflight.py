"""The launcher's checks that need no torch: data folders, flag combinations, output folders.

They run before torchrun, so the commonest mistakes are one line at once; the workers check the
data folders again and everything that needs torch.
"""

from __future__ import annotations

from pathlib import Path

from imgtrainer.checkpoints.remote import check_checkpoint_url, checkpoint_folder
from imgtrainer.checkpoints.run_folder import check_checkpoint_dir, explicit_resume_file
from imgtrainer.config import Layout, TrainConfig
from imgtrainer.data import (
    FOLDER,
    check_batch_fits,
    check_data_folders,
    check_device_options,
    count_images,
    data_reading,
    layout_of,
    open_datasets,
)
from imgtrainer.errors import UserError


def check_output_folders(cfg: TrainConfig) -> None:
    check_checkpoint_dir(checkpoint_folder(cfg))
    check_checkpoint_url(cfg)
    log_dir = Path(cfg.log_dir)
    if log_dir.exists() and not log_dir.is_dir():
        raise UserError(f"--log_dir {log_dir} is a file, not a folder; choose another --log_dir")
    if cfg.resume not in (None, "auto"):
        explicit_resume_file(cfg.resume)


def launcher_checks(cfg: TrainConfig, device_type: str, world_size: int) -> None:
    """Everything about the input that can be checked without torch, in a fraction of a second.
    (The demo data is written by the workers: it needs no check.)"""
    check_output_folders(cfg)
    check_device_options(cfg, device_type)
    if cfg.demo:
        return
    store = data_reading(cfg).store
    if {layout_of(cfg.train_dir, store), layout_of(cfg.val_dir, store)} != {FOLDER}:
        # A list, Parquet or shards: read once here (a shard set's index is built and kept
        # once, before the workers start), with every check of the workers' own reading.
        reading = data_reading(cfg)
        tables = open_datasets(
            cfg.train_dir, cfg.val_dir, cfg.class_names, Path(cfg.log_dir), reading=reading
        )
        check_batch_fits(len(tables[0]), cfg, world_size)
        return
    classes = check_data_folders(Path(cfg.train_dir), Path(cfg.val_dir))
    # Counted only as far as the checks need: a start does not wait for a million files here.
    enough = Layout.of(cfg, world_size).global_batch
    train_counts = count_images(Path(cfg.train_dir), classes, enough)
    check_batch_fits(sum(train_counts.values()), cfg, world_size)

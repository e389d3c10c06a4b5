"""Checks of a run's flags against its device and its data: options that need CUDA, an epoch of
at least one optimizer step. No torch here: the launcher runs them before torchrun."""

from __future__ import annotations

from imgtrainer.config import Layout, TrainConfig, optimizer_batch
from imgtrainer.errors import UserError


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
    if train_images >= Layout.of(cfg, world_size).global_batch:
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

"""Datasets, transforms, samplers and loaders, and the checks on the data folders.

Two properties make a run reproducible and resumable at any step:

* the order of training samples is a pure function of (seed, epoch): ``EpochSampler`` shuffles
  with a generator seeded from both, like ``DistributedSampler``;
* each sample's random augmentation is seeded from (seed, epoch, index), never from the loader
  worker that happened to handle it, so results do not change with ``--num_workers``.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from imgtrainer.data.checks import check_data_folders
from imgtrainer.data.samplers import EpochSampler, ShardSampler
from imgtrainer.data.sources import (
    DecodedImageCache,
    ReadableImageFolder,
    SeededImageDataset,
    choose_cache,
)
from imgtrainer.data.transforms import (
    EVAL_RESIZE_RATIO,
    IMAGENET_MEAN,
    IMAGENET_STD,
    build_transforms,
    collate_normalized,
)
from imgtrainer.data.unreadable import check_no_empty_class, leave_out_unreadable, report_unreadable
from imgtrainer.distributed.collectives import (
    all_gather_objects,
)
from imgtrainer.distributed.setup import (
    DistInfo,
    available_memory_bytes,
    cpu_cores_available,
)
from imgtrainer.run.config import (
    TrainConfig,
    optimizer_batch,
)
from imgtrainer.run.lifecycle import STOP_SIGNALS, die_with_parent, mark
from imgtrainer.run.preflight import check_batch_fits, check_device_options

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- loaders


def loader_workers(
    requested: int | None, cores_per_process: int, device_type: str = "cuda", cached: bool = False
) -> int:
    """--num_workers when given; else, with a GPU, up to 4 per process keep it fed. On the CPU
    the model already uses every core: workers only take cores from it, unless decoding files
    makes the data costly; images cached in memory are cheapest to augment in the training
    process itself."""
    if requested is not None:
        return requested
    if device_type == "cpu" and cached:
        return 0
    return max(0, min(4, cores_per_process))


def quiet_loader_worker(worker_id: int) -> None:
    """Loader workers leave stopping to their training process, and die with it.

    A signal sent to every process of a job (SLURM and Kubernetes before preemption; torchrun's
    agent, which signals each rank's whole process group) would otherwise kill them, and the
    DataLoader would raise "worker killed by signal" inside the step, before the rank could agree
    on a step and save its checkpoint. The parent-death signal ends them when their training
    process is gone, however it ended."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


def make_loader(
    dataset: Dataset,
    sampler: Sampler,
    batch_size: int,
    *,
    train: bool,
    num_workers: int,
    pin_memory: bool,
    prefetch_factor: int = 2,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=train,
        collate_fn=partial(collate_normalized, mean=tuple(mean), std=tuple(std)),
        # Its own generator: the loader's worker seeds must not draw from the process's random
        # stream, which a resumed run restores (the augmentation is seeded per sample anyway).
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=quiet_loader_worker,
        # Workers live across epochs: no re-fork (and re-import) cost at every epoch start.
        persistent_workers=num_workers > 0,
        # Batches each worker prepares ahead; each one waits in (pinned) host memory.
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


def build_datasets(
    train_dir: Path,
    val_dir: Path,
    image_size: int,
    seed: int,
    crop_scale_min: float,
    hflip: float,
    *,
    eval_resize_ratio: float = EVAL_RESIZE_RATIO,
    log_dir: Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    cache: str = "none",
    cache_budget_bytes: int = 0,
    cache_device: str = "cpu",
    threads: int = 4,
    auto_augment: str = "none",
    random_erasing: float = 0.0,
) -> tuple[SeededImageDataset, SeededImageDataset, list[str]]:
    """Both datasets, with unreadable images left out (listed in ``log_dir``). Every rank must
    call this: the decoding check is shared out over ranks (``rank`` of ``world_size``).
    ``cache`` "ram" or "gpu" instead decodes every image once (``DecodedImageCache``), which
    is the check; "auto" means "ram" when the decoded images fit in ``cache_budget_bytes``."""
    class_names = check_data_folders(train_dir, val_dir)
    folders = {
        "training": ReadableImageFolder(train_dir),
        "validation": ReadableImageFolder(val_dir),
    }
    cache = choose_cache(cache, sum(map(len, folders.values())), image_size, cache_budget_bytes)
    # Free memory differs between nodes; every rank must read the same images the same way.
    if "none" in all_gather_objects(cache):
        cache = "none"
    if cache == "none":
        leave_out_unreadable(folders, log_dir, rank, world_size, cache_dir=log_dir)
        mark("data checked")
        train_folder, val_folder = folders["training"], folders["validation"]
    else:
        # Caching decodes every image anyway: that decoding is the check, instead of a decode
        # check first and a second decoding of every image after it.
        mark("data checked")
        started = time.perf_counter()
        train_folder, val_folder = cache_decoded(
            folders, image_size, cache_device, threads, log_dir, eval_resize_ratio
        )
        mark("images cached")
        log.info(
            f"Cached {len(train_folder) + len(val_folder)} decoded images in {cache} "
            f"({(train_folder.nbytes + val_folder.nbytes) / 2**20:.0f} MiB, "
            f"{time.perf_counter() - started:.1f}s); --cache_images none reads the files "
            "every epoch instead"
        )
    train_set = SeededImageDataset(
        train_folder,
        build_transforms(
            image_size,
            True,
            crop_scale_min,
            hflip,
            auto_augment=auto_augment,
            random_erasing=random_erasing,
        ),
        seed,
    )
    val_set = SeededImageDataset(
        val_folder,
        build_transforms(image_size, False, eval_resize_ratio=eval_resize_ratio),
        seed,
    )
    return train_set, val_set, class_names


def cache_decoded(
    folders: dict[str, ReadableImageFolder],
    image_size: int,
    device: str,
    threads: int,
    log_dir: Path | None,
    eval_resize_ratio: float = EVAL_RESIZE_RATIO,
) -> tuple[DecodedImageCache, DecodedImageCache]:
    """The training and validation images decoded into memory, the files that do not decode
    left out as ``leave_out_unreadable`` leaves them out (one warning, the list in ``log_dir``,
    an error for a class left without images). Every rank must call this.

    Validation images are kept at the evaluation resize (``eval_resize_ratio``), so the
    evaluation transform only crops them; training images at the default ratio's side."""
    ratios = {"training": EVAL_RESIZE_RATIO, "validation": eval_resize_ratio}
    cached = {
        role: DecodedImageCache(folder, image_size, device, threads, ratios[role])
        for role, folder in folders.items()
    }
    # A file that fails to decode on one rank is left out on all of them: the ranks must
    # shuffle the same dataset.
    unreadable = {
        path: why
        for part in all_gather_objects(
            {path: why for c in cached.values() for path, why in c.unreadable.items()}
        )
        for path, why in part.items()
    }
    if unreadable:
        report_unreadable(unreadable, sum(map(len, folders.values())), log_dir)
    for role, folder in folders.items():
        folder.leave_out(unreadable)
        check_no_empty_class(folder, role)
        cached[role].leave_out(set(unreadable))
    return cached["training"], cached["validation"]


# ----------------------------------------------------------------------------- set-up pieces


def build_loaders(cfg: TrainConfig, dist: DistInfo):
    check_device_options(cfg, dist.device.type)
    cores = max(1, cpu_cores_available() // dist.local_world_size)
    # --cache_images auto: decoded images may take a quarter of this process's share of the RAM.
    budget = available_memory_bytes() // (4 * dist.local_world_size)
    train_set, val_set, class_names = build_datasets(
        Path(cfg.train_dir),
        Path(cfg.val_dir),
        cfg.image_size,
        cfg.seed,
        cfg.crop_scale_min,
        cfg.hflip,
        eval_resize_ratio=cfg.eval_resize_ratio,
        log_dir=Path(cfg.log_dir),
        rank=dist.rank,
        world_size=dist.world_size,
        cache=cfg.cache_images,
        cache_budget_bytes=budget,
        cache_device=str(dist.device) if cfg.cache_images == "gpu" else "cpu",
        threads=cores,
        auto_augment=cfg.auto_augment,
        random_erasing=cfg.random_erasing,
    )
    cached = isinstance(train_set.folder, DecodedImageCache)
    check_batch_fits(len(train_set), cfg, dist.world_size)
    train_sampler = EpochSampler(len(train_set), dist.rank, dist.world_size, cfg.seed)
    workers = loader_workers(cfg.num_workers, cores, dist.device.type, cached)
    pin = dist.device.type == "cuda"
    if cfg.cache_images == "gpu":  # batches are made on the device by the main process
        workers, pin = 0, False
    # One loader batch is one optimizer step: --accum_steps batches of --batch_size, which the
    # engine runs as separate forward/backward passes. Loading them together keeps the sample
    # order and the resume position independent of how a step is split.
    train_loader = make_loader(
        train_set,
        train_sampler,
        optimizer_batch(cfg),
        train=True,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=cfg.prefetch_factor,
    )
    val_loader = make_loader(
        val_set,
        ShardSampler(len(val_set), dist.rank, dist.world_size),
        cfg.batch_size,
        train=False,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=cfg.prefetch_factor,
    )
    return train_loader, val_loader, train_sampler, class_names

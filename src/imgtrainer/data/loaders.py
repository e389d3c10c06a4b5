"""The run's datasets and loaders, built from the config.

Sample order is a function of (seed, epoch) and each sample's augmentation of (seed, epoch,
index), so a run resumes at any step and does not change with ``--num_workers``.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from imgtrainer.config import (
    TrainConfig,
    effective_batch,
    optimizer_batch,
)
from imgtrainer.data.balance import class_counts, imbalance_note
from imgtrainer.data.batch_augment import (
    AugmentDraws,
    DeviceBatches,
    collate_samples,
    train_augmentation,
)
from imgtrainer.data.cache_fill import shared_caches
from imgtrainer.data.checks import check_batch_fits, check_device_options
from imgtrainer.data.jpeg_device import JpegDecoder
from imgtrainer.data.layouts import describe, open_datasets
from imgtrainer.data.samplers import BalancedClassSampler, EpochSampler, ShardSampler
from imgtrainer.data.sources import (
    GPU_CACHE_SHARE,
    DecodedImageCache,
    SeededImageDataset,
    Source,
    TrainingSamples,
    canvas_bytes,
    choose_cache,
    choose_source,
    estimated_canvas_bytes,
    fit_device_cache,
)
from imgtrainer.data.table import TableImages
from imgtrainer.data.transforms import (
    EVAL_RESIZE_RATIO,
    IMAGENET_MEAN,
    IMAGENET_STD,
    collate_normalized,
    eval_transforms,
)
from imgtrainer.data.unreadable import DecodeCheck, check_no_empty_class, report_unreadable
from imgtrainer.distributed import heartbeat
from imgtrainer.distributed.collectives import (
    all_gather_objects,
)
from imgtrainer.distributed.setup import (
    DistInfo,
    available_memory_bytes,
    cpu_cores_available,
    memory_share,
)
from imgtrainer.errors import UserError
from imgtrainer.files import format_bytes
from imgtrainer.process import STOP_SIGNALS, TorchrunEnv, die_with_parent

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- loaders


# Loader workers per process at most: each is a process holding its own prefetched batches.
MAX_LOADER_WORKERS = 16
# With the GPU cache a sample is a few draws (about 50-130 us with a policy): a few workers
# keep up with any step.
GPU_CACHE_WORKERS = 4


def loader_workers(
    requested: int | None,
    cores_per_process: int,
    device_type: str,
    source: Source | str = Source.FILES,
) -> int:
    """Loader worker processes per training process: ``--num_workers`` when given, else sized to
    this process's share of the cores and to what its ``source`` leaves the workers to do.

    With a GPU, one core stays with the main process to drive it and the others decode: files
    ("files", "nvjpeg") get all of them (JPEG decoding is the costliest per-image work), "ram"
    (decoded images in memory) half, "gpu" (images cached on the device: the workers only draw
    each sample's parameters and policy, from its size, never touching CUDA) half and at most
    GPU_CACHE_WORKERS, and each at least one so the draws overlap the step. On the CPU the
    model's threads already use every core: images in memory are cheapest to augment in the
    training process itself, files get up to 4."""
    source = Source(source)
    if requested is not None:
        return requested
    if cores_per_process < 1:  # more processes than cores: workers would only queue
        return 0
    if device_type == "cpu":
        return min(4, cores_per_process) if source.workers_decode else 0
    spare = max(1, cores_per_process - 1)
    if source is Source.GPU:
        return min(GPU_CACHE_WORKERS, max(1, spare // 2))
    return min(MAX_LOADER_WORKERS, spare if source.workers_decode else max(1, spare // 2))


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
    env = TorchrunEnv.read()
    # Its own heartbeat slot: the file it reads, for the launcher's hang watchdog.
    heartbeat.open_slot(env.rank, env.restart_count, worker_id)


@dataclass(frozen=True)
class LoaderSpec:
    """How a loader batches: ``train`` drops the last partial batch; ``mean``/``std`` normalise
    each batch as it is collated."""

    batch_size: int
    train: bool
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD


def make_loader(dataset: Dataset, sampler: Sampler, spec: LoaderSpec) -> DataLoader:
    """Training samples are collated as uint8 pixels and parameters for ``BatchAugment``;
    evaluation images are normalised as they are collated."""
    if isinstance(dataset, TrainingSamples):
        collate = collate_samples
        dataset = dataset.for_loader()  # for the GPU cache: sizes and labels, not the canvas
    else:
        collate = partial(collate_normalized, mean=tuple(spec.mean), std=tuple(spec.std))
    return DataLoader(
        dataset,
        batch_size=spec.batch_size,
        sampler=sampler,
        num_workers=spec.num_workers,
        pin_memory=spec.pin_memory,
        drop_last=spec.train,
        collate_fn=collate,
        # Its own generator: the loader's worker seeds must not draw from the process's random
        # stream, which a resumed run restores (the augmentation is seeded per sample anyway).
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=quiet_loader_worker,
        # Workers live across epochs: no re-fork (and re-import) cost at every epoch start.
        persistent_workers=spec.num_workers > 0,
        # Batches each worker prepares ahead; each one waits in (pinned) host memory.
        prefetch_factor=spec.prefetch_factor if spec.num_workers > 0 else None,
    )


class Datasets(NamedTuple):
    train: TrainingSamples
    val: SeededImageDataset
    class_names: list[str]
    check: DecodeCheck  # finish it at the end of the first epoch, on every rank


def build_datasets(
    cfg: TrainConfig,
    dist: DistInfo,
    *,
    draws: AugmentDraws | None = None,
    cache_budget_bytes: int = 0,
    threads: int = 4,
    device_budget_bytes: int = 0,
) -> Datasets:
    """Both datasets of ``cfg``, and the check of their images (``DecodeCheck``, running in
    the background: the first step does not wait for it; the unreadable images are left out
    and listed in ``--log_dir`` once it is finished). Every rank must call this.
    ``--cache_images`` "ram" keeps each image decoded the first time a step reads it
    (``SharedImageCache``, up to ``cache_budget_bytes`` for auto). "gpu" decodes every image
    first, which is the check: the device canvas is sized and checked from the decoded sizes
    before it is allocated (``settle_device_cache``): auto falls back to "ram", an explicit
    "gpu" is an error. "auto" means "gpu" when the decoded images should fit in
    ``device_budget_bytes``, else "ram" when they should fit in ``cache_budget_bytes``.
    ``threads`` decode the images for the device. Here the training images' ``Source`` is
    decided, once. ``draws``: the host half of ``train_augmentation(cfg)`` (made here when not
    given)."""
    log_dir = Path(cfg.log_dir)
    folders = read_datasets(cfg, threads)
    class_names = folders["training"].classes
    cache, why = choose_cache(
        cfg.cache_images,
        sum(map(len, folders.values())),
        cfg.image_size,
        cache_budget_bytes,
        device_budget_bytes,
    )
    cache, why = least_cache(cache, why)
    if choose_source(cache, dist.device) is Source.GPU:
        train_folder, val_folder, cache, why = device_cache(
            cfg, dist, folders, threads, device_budget_bytes, why
        )
        check = DecodeCheck({}, log_dir)  # decoding every image was the check
    else:
        check = DecodeCheck(folders, log_dir, dist.rank, dist.world_size, cache_dir=log_dir)
        train_folder, val_folder = folders["training"], folders["validation"]
        if cache != "none":
            capacity = ram_cache_capacity(cfg.cache_images, cache_budget_bytes, dist)
            ratios = {"training": EVAL_RESIZE_RATIO, "validation": cfg.eval_resize_ratio}
            caches = shared_caches(folders, cfg.image_size, capacity, ratios)
            train_folder, val_folder = caches["training"], caches["validation"]
            why += (
                f"; filled as the images are first read, up to {format_bytes(capacity, 'MiB', 0)}"
            )
        val_folder = check.readable("validation", val_folder)
        log.info(f"Image cache: {cache} ({why})")
    source = choose_source(cache, dist.device)  # where the training images are, decided once
    if draws is None:
        draws, _ = train_augmentation(cfg)
    train_set = TrainingSamples(train_folder, draws, cfg.seed, source)
    val_set = SeededImageDataset(
        val_folder, eval_transforms(cfg.image_size, cfg.eval_resize_ratio), cfg.seed
    )
    return Datasets(train_set, val_set, class_names, check)


def read_datasets(cfg: TrainConfig, threads: int) -> dict[str, TableImages]:
    """The training and validation images of --train_data / --val_data, in any layout
    (``data.layouts``), with what was read logged."""
    tables = open_datasets(cfg.train_dir, cfg.val_dir, cfg.class_names, Path(cfg.log_dir), threads)
    for role, table in zip(("Training", "Validation"), tables, strict=True):
        log.info(f"{role} data: {describe(table)}")
    return {"training": TableImages(tables[0]), "validation": TableImages(tables[1])}


CACHE_ORDER = ["none", "ram", "gpu"]  # from the least memory needed to the most


def least_cache(cache: str, why: str) -> tuple[str, str]:
    """The cache every rank can use: the least memory-hungry of the ranks' choices. Free memory
    differs between nodes; every rank must read the same images the same way. Every rank must
    call this."""
    least = min(all_gather_objects(cache), key=CACHE_ORDER.index)
    if least != cache:
        return least, f"{why}, but another rank can only use {least}"
    return cache, why


def ram_cache_capacity(requested: str, budget_bytes: int, dist: DistInfo) -> int:
    """Bytes the RAM cache may fill: auto's budget (the estimate fit in it; images past it are
    read from their files), or, asked for explicitly, this process's share of the available
    memory (pages are only taken as images are cached)."""
    if requested == "auto":
        return budget_bytes
    return max(budget_bytes, available_memory_bytes() // dist.local_world_size)


def device_cache(
    cfg: TrainConfig, dist: DistInfo, folders: dict, threads: int, budget_bytes: int, why: str
) -> tuple[DecodedImageCache, DecodedImageCache, str, str]:
    """The images decoded into host memory first (in ``threads``; that decoding is the check),
    then packed on the device when their real canvas fits ``budget_bytes`` there
    (``settle_device_cache``), else kept in RAM (auto): (training, validation, cache, why)."""
    started = time.perf_counter()
    train_folder, val_folder = cache_decoded(
        folders, cfg.image_size, "cpu", threads, Path(cfg.log_dir), cfg.eval_resize_ratio
    )
    cache, why = settle_device_cache(cfg, (train_folder, val_folder), budget_bytes, why)
    log.info(f"Image cache: {cache} ({why})")
    if choose_source(cache, dist.device) is Source.GPU:
        train_folder.pack(dist.device)
        val_folder.pack(dist.device)
    log.info(
        f"Cached {len(train_folder) + len(val_folder)} decoded images in {cache} "
        f"({format_bytes(train_folder.nbytes + val_folder.nbytes, 'MiB', 0)}, "
        f"{time.perf_counter() - started:.1f}s); --cache_images none reads the files "
        "every epoch instead"
    )
    return train_folder, val_folder, cache, why


def settle_device_cache(
    cfg: TrainConfig, cached: Sequence[DecodedImageCache], budget_bytes: int, why: str
) -> tuple[str, str]:
    """ "gpu" or "ram" for images decoded into host memory and meant for the device, from the
    real size of their canvas (``canvas_bytes``) against ``budget_bytes`` (``fit_device_cache``),
    the same on every rank: one rank over its budget sends all to RAM (auto), or all stop with
    its error (explicit gpu). Every rank must call this, before packing."""
    real = sum(canvas_bytes(c.sizes, cfg.image_size) for c in cached)
    estimate = estimated_canvas_bytes(sum(map(len, cached)), cfg.image_size)
    try:
        verdict = fit_device_cache(cfg.cache_images, real, estimate, budget_bytes)
    except UserError as err:
        verdict = f"error: {err}"
    verdicts = all_gather_objects(verdict)
    for problem in verdicts:
        if problem.startswith("error: "):
            raise UserError(problem.removeprefix("error: "))
    for problem in verdicts:
        if problem != "gpu":
            return "ram", problem if problem == verdict else f"{problem} (on another rank)"
    return "gpu", f"{why}; {format_bytes(real, 'MiB', 0)} once decoded"


def cache_decoded(
    folders: dict[str, TableImages],
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


def device_cache_budget(cfg: TrainConfig, dist: DistInfo) -> int:
    """Bytes of device memory the image cache may take (0: none, or not known): with
    --cache_images auto, GPU_CACHE_SHARE of this process's share of what is free (every process
    on the device caches the images), capped by --max_memory_gb; with gpu, asked for explicitly,
    all of that share (a larger cache could not be allocated at all)."""
    if dist.device.type != "cuda" or cfg.cache_images not in ("auto", "gpu"):
        return 0
    free = torch.cuda.mem_get_info(dist.device)[0]
    share = memory_share(free, dist.processes_on_device, cfg.max_memory_gb)
    return int(share * GPU_CACHE_SHARE) if cfg.cache_images == "auto" else int(share)


def build_loaders(cfg: TrainConfig, dist: DistInfo):
    check_device_options(cfg, dist.device.type)
    draws, augment = train_augmentation(cfg)
    cores = max(1, cpu_cores_available() // dist.local_world_size)
    # --cache_images auto: decoded images may take a quarter of this process's share of the RAM,
    # or GPU_CACHE_SHARE of its share of the free device memory.
    budget = available_memory_bytes() // (4 * dist.local_world_size)
    train_set, val_set, class_names, check = build_datasets(
        cfg,
        dist,
        draws=draws,
        cache_budget_bytes=budget,
        threads=cores,
        device_budget_bytes=device_cache_budget(cfg, dist),
    )
    check_batch_fits(len(train_set), cfg, dist.world_size)
    train_sampler = build_train_sampler(cfg, train_set.folder.targets, class_names, dist)
    source = train_set.source
    workers = loader_workers(cfg.num_workers, cores, dist.device.type, source)
    pin = dist.device.type == "cuda" and source.host_batches
    chosen = cfg.num_workers is None
    log.info(
        f"Loader: {workers} worker(s) per process, images from {source} "
        + (
            f"({cores} CPU core(s) per process on this node; --num_workers N to choose)"
            if chosen
            else "(--num_workers)"
        )
    )
    # One loader batch is one optimizer step: --accum_steps batches of --batch_size, which the
    # engine runs as separate forward/backward passes. Loading them together keeps the sample
    # order and the resume position independent of how a step is split.
    train_spec = LoaderSpec(
        optimizer_batch(cfg),
        True,
        workers,
        pin,
        prefetch_factor=cfg.prefetch_factor,
        mean=augment.mean,
        std=augment.std,
    )
    jpegs = None
    if source is Source.NVJPEG:
        jpegs = JpegDecoder(dist.device, cfg.image_size, train_set.pixel_sample)
        log.info(
            "JPEG decode on the GPU (nvjpeg); on the CPU in the loader workers for other "
            "formats and for grayscale, CMYK, progressive and EXIF-rotated JPEGs, and in this "
            "process for a file the GPU fails on"
        )
    train_loader = DeviceBatches(
        make_loader(train_set, train_sampler, train_spec),
        augment,
        dist.device,
        train_set.canvas,
        jpegs,
        # Once the device decoder has switched itself off: the workers decode the JPEGs too.
        lambda: make_loader(
            TrainingSamples(train_set.folder, draws, cfg.seed, Source.FILES),
            train_sampler,
            train_spec,
        ),
    )
    val_loader = make_loader(
        val_set,
        # Its length is read as it runs: the check's end leaves unreadable images out.
        ShardSampler(val_set, dist.rank, dist.world_size),
        # Evaluation transforms the cached images themselves: on the device for the GPU cache,
        # which forked workers must not touch.
        replace(
            train_spec,
            batch_size=cfg.batch_size,
            train=False,
            num_workers=0 if source is Source.GPU else workers,
        ),
    )
    return Loaders(train_loader, val_loader, train_sampler, class_names, check)


class Loaders(NamedTuple):
    train: DeviceBatches
    val: DataLoader
    sampler: EpochSampler
    class_names: list[str]
    check: DecodeCheck  # finish it at the end of the first epoch, on every rank


def build_train_sampler(
    cfg: TrainConfig, targets: list[int], class_names: list[str], dist: DistInfo
) -> EpochSampler:
    """The training order of --sampler; first, one note when the classes are far apart in
    size (with the flags that balance them, unless the run uses one)."""
    note = imbalance_note(
        class_counts(targets, len(class_names)),
        class_names,
        handled=cfg.class_weights != "none" or cfg.sampler != "random",
    )
    if note:
        log.warning(note)
    if cfg.class_weights != "none" and cfg.sampler != "random":
        log.warning(
            "--class_weights balanced with --sampler balanced corrects the imbalance twice: "
            "the small classes are drawn as often as the others and weigh more too"
        )
    # Each optimizer step takes the next global batch of the epoch's order, whatever the
    # number of processes: a resume on another number goes on at the same sample.
    global_batch = effective_batch(cfg, dist.world_size)
    if cfg.sampler == "balanced":
        return BalancedClassSampler(targets, dist.rank, dist.world_size, cfg.seed, global_batch)
    return EpochSampler(len(targets), dist.rank, dist.world_size, cfg.seed, global_batch)

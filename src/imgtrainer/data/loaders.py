"""The run's loaders, built from the config: the one place in ``data`` that reads it. The
images are read (``layouts``), placed where the plan puts them (``image_plan``), drawn and
collated per sample in the loader workers (``host``) and augmented as whole batches on the
training device (``device``).

Sample order is a function of (seed, epoch) and each sample's augmentation of (seed, epoch,
index), so a run resumes at any step and does not change with ``--num_workers``.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from imgtrainer import heartbeat
from imgtrainer.config import Layout, TrainConfig, optimizer_batch
from imgtrainer.data.balance import class_counts, imbalance_note
from imgtrainer.data.checks import check_batch_fits, check_device_options
from imgtrainer.data.device.audit import DataAudit
from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.device.batches import BatchPlan, DeviceBatches
from imgtrainer.data.device.jpeg import JpegDecoder
from imgtrainer.data.device.mixing import BatchMixer, Mixing
from imgtrainer.data.device.policy import BatchPolicy
from imgtrainer.data.host.collate import collate_normalized, collate_samples
from imgtrainer.data.host.draws import AugmentDraws
from imgtrainer.data.host.read_ahead import ReadAhead, remote_table
from imgtrainer.data.host.samplers import (
    DEFAULT_WINDOW,
    BalancedClassSampler,
    EpochSampler,
    ShardSampler,
    WindowSampler,
)
from imgtrainer.data.host.samples import SeededImageDataset, Source, TrainingSamples
from imgtrainer.data.host.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transforms
from imgtrainer.data.image_plan import NO_BUDGET, Budgets, place_images, plan_images
from imgtrainer.data.layouts import describe, open_datasets, table_facts
from imgtrainer.data.layouts.decode_check import DecodeCheck
from imgtrainer.data.layouts.table import GROUP_ROWS, ImageTable, TableImages
from imgtrainer.data.reading import data_reading
from imgtrainer.distributed.setup import DistInfo, cpu_cores_available
from imgtrainer.errors import UserError
from imgtrainer.events import event
from imgtrainer.precision import precision_rule
from imgtrainer.process import STOP_SIGNALS, TorchrunEnv, die_with_parent

log = logging.getLogger(__name__)


class Loaders(NamedTuple):
    train: DeviceBatches
    val: DataLoader
    sampler: EpochSampler
    class_names: list[str]
    check: DecodeCheck  # finish it at the end of the first epoch, on every rank
    class_counts: list[int]  # training images per class
    mixer: BatchMixer | None  # --mixup/--cutmix, None when both are off


@dataclass(frozen=True)
class RunData:
    """The run's data before its training batches are made: the maker of the training loader's
    ``DeviceBatches`` and the audit and CPU path it takes (``batch_plan``), which the memory
    plan completes (``loaders``); the rest as ``Loaders`` holds it."""

    train_batches: Callable[[BatchPlan], DeviceBatches]
    batch_plan: BatchPlan
    steps_per_epoch: int
    source: Source  # where the training images live (``image_plan``)
    val: DataLoader
    sampler: EpochSampler
    class_names: list[str]
    check: DecodeCheck
    class_counts: list[int]
    mixer: BatchMixer | None

    def loaders(self, chunk: int | None = None, retry_on_oom: bool = False) -> Loaders:
        """The run's loaders, the training batches augmented ``chunk`` images at a time (all
        when None), an out-of-memory error retried in smaller pieces with ``retry_on_oom``."""
        plan = replace(self.batch_plan, chunk=chunk, retry_on_oom=retry_on_oom)
        return Loaders(
            self.train_batches(plan),
            self.val,
            self.sampler,
            self.class_names,
            self.check,
            self.class_counts,
            self.mixer,
        )


def open_data(cfg: TrainConfig, dist: DistInfo) -> RunData:
    """The run's data, its training batches not yet made. Every rank must call this. In order:
    the flags this device cannot run are refused; the augmentation is split into its host and
    device halves; both datasets are read and placed where the plan puts the images
    (``build_datasets``); the training order is drawn per epoch (``build_train_sampler``); the
    training loader's batches will be augmented on the device (``DeviceBatches``) and audited
    against the CPU reference (``data_audit``), the validation loader's normalised as they are
    collated; mixing follows the flags."""
    check_device_options(cfg, dist.device.type)
    draws, augment = train_augmentation(cfg, dist.device)
    cores = max(1, cpu_cores_available() // dist.local_world_size)
    datasets = build_datasets(cfg, dist, draws, Budgets.of(cfg, dist), cores)
    check_batch_fits(len(datasets.train), cfg, dist.world_size)
    counts = class_counts(datasets.train.targets, len(datasets.class_names))
    sampler = build_train_sampler(cfg, datasets.train, counts, datasets.class_names, dist)
    spec = train_loader_spec(cfg, dist, datasets.train.source, cores)
    source, chosen = datasets.train.source, cfg.num_workers is None
    facts = event("loader", workers=spec.num_workers, source=str(source), chosen=chosen)
    log.info(loader_line(spec, source, cores, chosen), extra=facts)
    batches = BatchPlan(
        audit=data_audit(cfg, datasets.train, augment, dist),
        cpu_path=cpu_path(
            datasets.train, sampler, train_loader_spec(cfg, dist, Source.FILES, cores)
        ),
    )
    val = make_loader(
        datasets.val,
        # Its length is read as it runs: the check's end leaves unreadable images out.
        ShardSampler(datasets.val, dist.rank, dist.world_size),
        # Evaluation transforms the cached images themselves: on the device for the GPU cache,
        # which forked workers must not touch.
        replace(
            spec,
            batch_size=cfg.batch_size,
            train=False,
            num_workers=0 if datasets.train.source is Source.GPU else spec.num_workers,
        ),
    )
    host_train = make_loader(datasets.train, sampler, spec)
    jpegs = device_jpeg_decoder(datasets.train, cfg, dist)
    return RunData(
        partial(DeviceBatches, host_train, augment, dist.device, datasets.train.canvas, jpegs),
        batches,
        len(host_train),
        datasets.train.source,
        val,
        sampler,
        datasets.class_names,
        datasets.check,
        counts,
        batch_mixer(cfg, len(datasets.class_names), dist),
    )


class Datasets(NamedTuple):
    train: TrainingSamples
    val: SeededImageDataset
    class_names: list[str]
    check: DecodeCheck  # finish it at the end of the first epoch, on every rank


def build_datasets(
    cfg: TrainConfig,
    dist: DistInfo,
    draws: AugmentDraws | None = None,
    budgets: Budgets = NO_BUDGET,
    threads: int = 4,
) -> Datasets:
    """Both datasets of ``cfg``, read in ``threads``, their images where ``plan_images``
    puts them (``budgets``: what --cache_images auto may take; none by default), and the
    check of their images (see ``place_images``). ``draws``: the host half of
    ``train_augmentation`` (made here when not given). Every rank must call this."""
    images = read_datasets(cfg, threads)
    plan = plan_images(cfg, dist, images, budgets, threads)
    train_images, val_images, check = place_images(plan, images, cfg, dist)
    draws = draws or train_augmentation(cfg, dist.device)[0]
    train_set = TrainingSamples(train_images, draws, cfg.seed, plan.source)
    val_set = SeededImageDataset(
        val_images, eval_transforms(cfg.image_size, cfg.eval_resize_ratio), cfg.seed
    )
    return Datasets(train_set, val_set, images["training"].classes, check)


def read_datasets(cfg: TrainConfig, threads: int) -> dict[str, TableImages]:
    """The training and validation images of --train_data / --val_data, in any layout
    (``layouts``), with what was read logged."""
    tables = open_datasets(
        cfg.train_dir, cfg.val_dir, cfg.class_names, Path(cfg.log_dir), threads, data_reading(cfg)
    )
    for role, table in zip(("Training", "Validation"), tables, strict=True):
        facts = table_facts(table)
        log.info(f"{role} data: {describe(table, facts)}", extra=event("data", role=role, **facts))
    return {"training": TableImages(tables[0]), "validation": TableImages(tables[1])}


def train_augmentation(cfg: TrainConfig, device: torch.device) -> tuple[AugmentDraws, BatchAugment]:
    """The training augmentation of ``cfg`` for a model on ``device``, the one place that reads
    the augmentation flags: RandomResizedCrop and the flip, then ``--auto_augment``'s policy,
    then random erasing, in the order of torchvision's reference recipe; the batches in the
    dtype and layout the model takes there."""
    draws = AugmentDraws(
        cfg.image_size,
        scale=(cfg.crop_scale_min, 1.0),
        hflip=cfg.hflip,
        random_erasing=cfg.random_erasing,
        policy=cfg.auto_augment,
    )
    policy = BatchPolicy(cfg.auto_augment, cfg.image_size) if cfg.auto_augment != "none" else None
    precision = precision_rule(cfg.use_amp, cfg.low_memory, cfg.amp_dtype, torch.device(device))
    augment = BatchAugment(
        cfg.image_size, policy, IMAGENET_MEAN, IMAGENET_STD, cfg.channels_last, precision
    )
    return draws, augment


def batch_mixer(cfg: TrainConfig, num_classes: int, dist: DistInfo) -> BatchMixer | None:
    """The run's mixup/cutmix (``BatchMixer``), or None when neither --mixup nor --cutmix is on."""
    mixing = mixing_of(cfg, dist.world_size)
    return BatchMixer(mixing, num_classes, dist.rank, dist.device) if mixing.enabled else None


def mixing_of(cfg: TrainConfig, world_size: int) -> Mixing:
    """The mixing flags of ``cfg``: the last --mix_off_epochs train unmixed."""
    return Mixing(
        mixup=cfg.mixup,
        cutmix=cfg.cutmix,
        switch_prob=cfg.mix_switch_prob,
        mixed_epochs=cfg.epochs - cfg.mix_off_epochs,
        seed=cfg.seed,
        global_batch=Layout.of(cfg, world_size).global_batch,
    )


def build_train_sampler(
    cfg: TrainConfig,
    train_set: TrainingSamples,
    counts: list[int],
    class_names: list[str],
    dist: DistInfo,
) -> EpochSampler:
    """The training order of --sampler; first, one note when the classes are far apart in
    size (with the flags that balance them, unless the run uses one)."""
    note = imbalance_note(
        counts, class_names, handled=cfg.class_weights != "none" or cfg.sampler == "balanced"
    )
    if note:
        log.warning(note)
    if cfg.class_weights != "none" and cfg.sampler == "balanced":
        log.warning(
            "--class_weights balanced with --sampler balanced corrects the imbalance twice: "
            "the small classes are drawn as often as the others and weigh more too"
        )
    # Each optimizer step takes the next global batch of the epoch's order, whatever the
    # number of processes: a resume on another number goes on at the same sample.
    global_batch = Layout.of(cfg, dist.world_size).global_batch
    args = (dist.rank, dist.world_size, cfg.seed, global_batch)
    if cfg.sampler == "balanced":
        return BalancedClassSampler(train_set.targets, *args)
    if cfg.sampler == "window":
        return window_sampler(cfg, train_set.images.table, args)
    return EpochSampler(len(train_set), *args)


def window_sampler(cfg: TrainConfig, table: ImageTable, args: tuple) -> WindowSampler:
    """--sampler window over ``table``'s groups (shards, row groups, groups of rows), with
    one line saying how it reads; ``UserError`` for a window larger than the data."""
    groups, count = table.groups(), table.num_groups
    if cfg.shuffle_window is not None and cfg.shuffle_window > count:
        raise UserError(
            f"--shuffle_window {cfg.shuffle_window} is more than the training data's {count} "
            f"groups (shards, Parquet row groups or {GROUP_ROWS} images of a folder or list); "
            f"give at most {count}"
        )
    sampler = WindowSampler(groups, *args, window=cfg.shuffle_window or min(DEFAULT_WINDOW, count))
    how = "fetched whole ahead of need" if table.remote else "read from the disk"
    log.info(
        f"Training order: --sampler window, the images of {sampler.window} of {count} groups "
        f"mixed at a time, {sampler.lanes} read side by side, {how} (the default for data in "
        "object storage; --sampler random shuffles the whole epoch)",
        extra=event("order", sampler="window", window=sampler.window, groups=count),
    )
    return sampler


def train_loader_spec(cfg: TrainConfig, dist: DistInfo, source: Source, cores: int) -> LoaderSpec:
    """How the training loader batches: one loader batch is one optimizer step (--accum_steps
    batches of --batch_size, run as separate forward/backward passes: loading them together
    keeps the sample order and the resume position independent of how a step is split), with
    workers sized to this process's ``cores`` and to what ``source`` leaves them to do."""
    return LoaderSpec(
        optimizer_batch(cfg),
        True,
        loader_workers(cfg.num_workers, cores, dist.device.type, source),
        pin_memory=dist.device.type == "cuda" and source.host_batches,
        prefetch_factor=cfg.prefetch_factor,
    )


def loader_line(spec: LoaderSpec, source: Source, cores: int, chosen: bool) -> str:
    """The log line of the training loader: its workers, and whether they were ``chosen``."""
    how = (
        f"({cores} CPU core(s) per process on this node; --num_workers N to choose)"
        if chosen
        else "(--num_workers)"
    )
    return f"Loader: {spec.num_workers} worker(s) per process, images from {source} {how}"


def device_jpeg_decoder(
    train_set: TrainingSamples, cfg: TrainConfig, dist: DistInfo
) -> JpegDecoder | None:
    """The JPEG decoder on the device for ``Source.NVJPEG``; None for any other source."""
    if train_set.source is not Source.NVJPEG:
        return None
    log.info(
        "JPEG decode on the GPU (nvjpeg); on the CPU in the loader workers for other "
        "formats and for grayscale, CMYK, progressive and EXIF-rotated JPEGs, and in this "
        "process for a file the GPU fails on"
    )
    return JpegDecoder(dist.device, cfg.image_size, train_set.pixel_sample)


def cpu_path(
    train_set: TrainingSamples, sampler: EpochSampler, spec: LoaderSpec
) -> Callable[[], DataLoader] | None:
    """For a source with a device half (``Source.NVJPEG``'s decoding, ``Source.GPU``'s cached
    crops), a maker of the loader whose workers do that on the CPU with the same draws; None
    for the others, whose workers do it already."""
    if train_set.source is Source.NVJPEG:
        images, source = train_set.images, Source.FILES
    elif train_set.source is Source.GPU:
        images, source = train_set.images.reference(), Source.RAM  # decoded again from files
    else:
        return None
    samples = TrainingSamples(images, train_set.draws, train_set.seed, source)
    return partial(make_loader, samples, sampler, spec)


def data_audit(
    cfg: TrainConfig, train_set: TrainingSamples, augment: BatchAugment, dist: DistInfo
) -> DataAudit | None:
    """The run's data audit (--audit_data_every), or None when it is off: the training
    images' CPU reference, and the augmentation's reference form on the CPU."""
    if not cfg.audit_data_every:
        return None
    reference = BatchAugment(cfg.image_size, augment.policy, augment.mean, augment.std)
    return DataAudit(
        train_set.images.reference(), reference, train_set.source, cfg.audit_data_every, dist.device
    )


# Loader workers per process at most: each is a process holding its own prefetched batches.
MAX_LOADER_WORKERS = 16
# With the GPU cache a sample is only its draws (no file, no pixels): a few workers keep up with
# any step.
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
    each sample's row from its size, never touching CUDA) half and at most
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


def quiet_loader_worker(worker_id: int, kind: str = heartbeat.TRAIN_WORKER) -> None:
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
    # Its own heartbeat slot (``kind``: of a training or an evaluation loader): how the
    # launcher's hang watchdog finds it, and judges it when its rank waits for data.
    heartbeat.open_slot(env.rank, env.restart_count, worker_id, kind)


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
    """Training samples are collated as uint8 pixels and sample rows for ``BatchAugment``;
    evaluation images are normalised as they are collated. Images in an object store are read
    a batch at a time, many at once, and in a window order whole shards ahead (``ReadAhead``)."""
    if isinstance(dataset, TrainingSamples):
        collate = collate_samples
        dataset = dataset.for_loader()  # for the GPU cache: sizes and labels, not the canvas
    else:
        collate = partial(collate_normalized, mean=tuple(spec.mean), std=tuple(spec.std))
    table = remote_table(dataset)
    if table is not None:
        # Whole shards ahead of need in an order that reads them one after another.
        in_groups = isinstance(sampler, WindowSampler | ShardSampler)
        dataset = ReadAhead(dataset, table, sampler if in_groups else None)
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
        worker_init_fn=partial(
            quiet_loader_worker,
            kind=heartbeat.TRAIN_WORKER if spec.train else heartbeat.EVAL_WORKER,
        ),
        # Workers live across epochs: no re-fork (and re-import) cost at every epoch start.
        persistent_workers=spec.num_workers > 0,
        # Batches each worker prepares ahead; each one waits in (pinned) host memory.
        prefetch_factor=spec.prefetch_factor if spec.num_workers > 0 else None,
    )

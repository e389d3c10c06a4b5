"""Where a run's images live: read from their files every epoch, decoded once into RAM, or decoded
once onto the training device. ``plan_images`` decides it once, the same on every rank, from
``--cache_images`` and the memory there is; ``place_images`` puts the datasets there."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import Dataset

from imgtrainer import torch_compat
from imgtrainer.config import TrainConfig
from imgtrainer.data.host.image_cache import (
    CANVAS_ASPECT,
    DecodedImageCache,
    canvas_bytes,
    shared_caches,
)
from imgtrainer.data.host.samples import Source, choose_source
from imgtrainer.data.host.transforms import EVAL_RESIZE_RATIO, eval_resize_side
from imgtrainer.data.layouts.decode_check import DecodeCheck, gather_unreadable, settle_unreadable
from imgtrainer.data.layouts.table import TableImages
from imgtrainer.distributed.collectives import all_gather_objects
from imgtrainer.distributed.setup import DistInfo, available_memory_bytes, memory_share
from imgtrainer.errors import UserError
from imgtrainer.events import event
from imgtrainer.files import format_bytes

log = logging.getLogger(__name__)

# --cache_images auto: the share of the free device memory the GPU cache may take (the model,
# its activations and the batch's float copies need the rest).
GPU_CACHE_SHARE = 0.25
CACHE_ORDER = ("none", "ram", "gpu")  # from the least memory needed to the most


class Budgets(NamedTuple):
    """Bytes the decoded images may take with --cache_images auto, in this process's RAM and
    on its device (0: none)."""

    ram: int = 0
    device: int = 0

    @classmethod
    def of(cls, cfg: TrainConfig, dist: DistInfo) -> Budgets:
        """A quarter of this process's share of the available RAM, and ``device_cache_budget``."""
        ram = available_memory_bytes() // (4 * dist.local_world_size)
        return cls(ram, device_cache_budget(cfg, dist))


NO_BUDGET = Budgets()  # --cache_images auto then caches nothing


@dataclass(frozen=True)
class ImagePlan:
    """Where the images live: ``cache`` ("none", "ram" or "gpu", --cache_images settled),
    ``source`` (what a training sample hands over), ``capacity`` (bytes the RAM cache fills as
    the images are first read), ``why`` (for the log) and, for the GPU cache, the images
    ``decoded`` up front by role (on the device, or kept in RAM where they did not fit)."""

    cache: str
    source: Source
    capacity: int
    why: str
    decoded: dict[str, DecodedImageCache] | None = None


def plan_images(
    cfg: TrainConfig,
    dist: DistInfo,
    images: dict[str, TableImages],
    budgets: Budgets,
    threads: int,
) -> ImagePlan:
    """The plan of ``--cache_images``: "auto" takes the device when the estimated canvas fits
    ``budgets.device``, else RAM when the estimated images fit ``budgets.ram``, else none; every
    rank takes the least of the ranks' choices. The GPU cache decodes every image first (in
    ``threads``; that decoding is the check) and keeps them in RAM when their real canvas does
    not fit (auto; an explicit "gpu" is an error). Every rank must call this."""
    total = sum(map(len, images.values()))
    cache, why = choose_cache(cfg.cache_images, total, cfg.image_size, budgets)
    cache, why = least_cache(cache, why)
    source = safe_decoding(choose_source(cache, dist.device))
    if source is Source.GPU:
        return decoded_plan(cfg, dist, images, budgets.device, threads, why)
    capacity = 0
    if source is Source.RAM:
        capacity = ram_cache_capacity(cfg.cache_images, budgets.ram, dist)
        why += f"; filled as the images are first read, up to {format_bytes(capacity, 'MiB', 0)}"
    log_plan(cache, source, why)
    return ImagePlan(cache, source, capacity, why)


def safe_decoding(source: Source) -> Source:
    """``source``, but JPEGs read from files are decoded by the loader workers rather than by
    nvJPEG under the cudaMallocAsync allocator, which can hand nvJPEG's private stream memory
    that queued work still reads (pytorch/vision#9606): one line says so."""
    if source is not Source.NVJPEG or torch_compat.cuda_allocator_backend() != "cudaMallocAsync":
        return source
    log.warning(
        "PYTORCH_CUDA_ALLOC_CONF selects the cudaMallocAsync allocator, under which nvJPEG can "
        "write memory that queued work still reads (pytorch/vision#9606): the loader workers "
        "decode the JPEGs instead; drop backend:cudaMallocAsync to decode them on the GPU"
    )
    return Source.FILES


def log_plan(cache: str, source: Source, why: str) -> None:
    """The cache chosen, for people and as an event."""
    facts = event("image_cache", cache=cache, source=str(source), why=why)
    log.info(f"Image cache: {cache} ({why})", extra=facts)


def place_images(
    plan: ImagePlan, images: dict[str, TableImages], cfg: TrainConfig, dist: DistInfo
) -> tuple[Dataset, Dataset, DecodeCheck]:
    """The training and validation images where ``plan`` puts them, and the decode check of
    the images not decoded up front (``DecodeCheck``, running in the background from here:
    the first step does not wait for it; every rank finishes it at the end of the first
    epoch, which leaves the unreadable validation images out)."""
    log_dir = Path(cfg.log_dir)
    if plan.decoded is not None:  # decoding every image was the check
        return plan.decoded["training"], plan.decoded["validation"], DecodeCheck({}, log_dir)
    check = DecodeCheck(images, log_dir, dist.rank, dist.world_size, cache_dir=log_dir)
    if plan.source is Source.RAM:
        images = shared_caches(images, cfg.image_size, plan.capacity, cache_ratios(cfg))
    return images["training"], check.readable("validation", images["validation"]), check


def cache_ratios(cfg: TrainConfig) -> dict[str, float]:
    """Each role's resize ratio in the caches: training images at the default ratio's side,
    validation images at --eval_resize_ratio's, so evaluation only crops them."""
    return {"training": EVAL_RESIZE_RATIO, "validation": cfg.eval_resize_ratio}


# ----------------------------------------------------------------------------- the estimates


def choose_cache(
    cache: str, num_images: int, image_size: int, budgets: Budgets = NO_BUDGET
) -> tuple[str, str]:
    """``auto``: the fastest place the decoded images should fit, and why: the device when its
    padded canvas (4:3 photos of both orientations: a square of the longer side) fits
    ``budgets.device``, else RAM when the packed images fit ``budgets.ram``, else none."""
    if cache != "auto":
        return cache, f"--cache_images {cache}"
    side = eval_resize_side(image_size)
    packed = num_images * 3 * side**2 * 4 // 3  # 4:3 photos, the usual shape
    canvas = estimated_canvas_bytes(num_images, image_size)
    if 0 < canvas <= budgets.device:
        return "gpu", (
            f"auto: ~{format_bytes(canvas, 'MiB', 0)} fit in {GPU_CACHE_SHARE:.0%} of the free device "
            "memory"
        )
    if packed <= budgets.ram:
        where = "; too large for the device" if budgets.device else ""
        return "ram", f"auto: ~{format_bytes(packed, 'MiB', 0)} fit in the RAM budget{where}"
    return "none", f"auto: ~{format_bytes(packed, 'MiB', 0)} do not fit in the RAM budget"


def estimated_canvas_bytes(num_images: int, image_size: int) -> int:
    """The device canvas ``choose_cache`` assumes before decoding: every image at the training
    cache's side S, a square of ceil(4/3 S) (4:3 photos of both orientations)."""
    return num_images * 3 * math.ceil(eval_resize_side(image_size) * CANVAS_ASPECT) ** 2


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


# ----------------------------------------------------------------------------- the GPU cache


def decoded_plan(
    cfg: TrainConfig,
    dist: DistInfo,
    images: dict[str, TableImages],
    budget_bytes: int,
    threads: int,
    why: str,
) -> ImagePlan:
    """The images decoded into host memory first (``decode_up_front``), then packed on the
    device when their real canvas fits ``budget_bytes`` there (``settle_device_cache``), else
    kept in RAM (auto). Every rank must call this."""
    started = time.perf_counter()
    decoded = decode_up_front(images, cfg, dist.world_size, threads)
    cache, why = settle_device_cache(cfg, decoded.values(), budget_bytes, why)
    source = choose_source(cache, dist.device)
    log_plan(cache, source, why)
    if source is Source.GPU:
        for role in decoded:
            decoded[role].pack(dist.device)
    log.info(
        f"Cached {sum(map(len, decoded.values()))} decoded images in {cache} "
        f"({format_bytes(sum(c.nbytes for c in decoded.values()), 'MiB', 0)}, "
        f"{time.perf_counter() - started:.1f}s); --cache_images none reads the files "
        "every epoch instead"
    )
    return ImagePlan(cache, source, 0, why, decoded)


def decode_up_front(
    images: dict[str, TableImages], cfg: TrainConfig, world_size: int, threads: int
) -> dict[str, DecodedImageCache]:
    """Every image decoded into host memory, by role (``cache_ratios``); that decoding is the
    check: a file that does not decode on any rank is left out on all of them (one warning,
    the list in --log_dir; an error for a class left without images). Every rank must call
    this."""
    ratios = cache_ratios(cfg)
    decoded = {
        role: DecodedImageCache(dataset.table, cfg.image_size, "cpu", threads, ratios[role])
        for role, dataset in images.items()
    }
    found = gather_unreadable({role: c.unreadable for role, c in decoded.items()}, world_size)
    tables = {role: dataset.table for role, dataset in images.items()}
    unreadable = settle_unreadable(tables, found, Path(cfg.log_dir))
    for cached in decoded.values():
        cached.leave_out(set(unreadable))
    return decoded


def settle_device_cache(
    cfg: TrainConfig, cached: Iterable[DecodedImageCache], budget_bytes: int, why: str
) -> tuple[str, str]:
    """ "gpu" or "ram" for images decoded into host memory and meant for the device, from the
    real size of their canvas (``canvas_bytes``) against ``budget_bytes`` (``fit_device_cache``),
    the same on every rank: one rank over its budget sends all to RAM (auto), or all stop with
    its error (explicit gpu). Every rank must call this, before packing."""
    cached = list(cached)
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


def fit_device_cache(cache: str, real_bytes: int, estimate_bytes: int, budget_bytes: int) -> str:
    """After decoding, before packing: "gpu" when the canvas of ``real_bytes`` fits
    ``budget_bytes`` (0: not known, not checked), else why not. ``cache`` "auto" then falls back
    to RAM (the images are decoded there already): the reason, for the log; an explicit "gpu"
    raises ``UserError``, before a device allocation that would fail or starve training."""
    if budget_bytes <= 0 or real_bytes <= budget_bytes:
        return "gpu"
    size, over = format_bytes(real_bytes, "MiB", 0), format_bytes(budget_bytes, "MiB", 0)
    if cache == "auto":
        times = real_bytes / max(1, estimate_bytes)
        return (
            f"auto: the GPU cache would take {size} ({times:.1f}x the estimate), over {over}; "
            "using ram"
        )
    raise UserError(
        f"--cache_images gpu: the decoded images need {size} on the device, over the {over} "
        "this process can use there; use --cache_images ram (or auto), or a smaller --image_size"
    )

"""Datasets, transforms, samplers and loaders, and the checks on the data folders.

Two properties make a run reproducible and resumable at any step:

* the order of training samples is a pure function of (seed, epoch): ``EpochSampler`` shuffles
  with a generator seeded from both, like ``DistributedSampler``;
* each sample's random augmentation is seeded from (seed, epoch, index), never from the loader
  worker that happened to handle it, so results do not change with ``--num_workers``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate
from torchvision import datasets
from torchvision.transforms import v2

from distributed import all_gather_objects
from errors import UserError
from image_files import (
    IMAGE_EXTENSIONS,
    find_unreadable,
    is_image_file,
    open_rgb,
    write_unreadable_list,
)
from lifecycle import STOP_SIGNALS, die_with_parent, mark
from preflight import check_data_folders, find_classes  # noqa: F401 (also used by evaluate.py)

log = logging.getLogger(f"trainer.{__name__}")  # under the project logger

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The default of --eval_resize_ratio (timm's crop_pct): resize to size/0.875, then center-crop
# to size (the usual 224/256).
EVAL_RESIZE_RATIO = 0.875


# ----------------------------------------------------------------------------- folder checks

# find_classes and check_data_folders need no torch, so they live in preflight.py, where the
# launcher runs them too; they are imported above for the data code and its callers.

# ----------------------------------------------------------------------------- transforms


class RandomResizedCropFlip:
    """torchvision's RandomResizedCrop then RandomHorizontalFlip, on uint8 images, drawing all its
    random numbers from the torch generator in one call.

    The same distribution and the same bilinear, antialiased resize as the v2 transforms, for a
    fraction of their cost: their Python dispatch took ~0.25 ms per image, more than the crop
    itself at small sizes, and on a 2-core machine the augmentation competes with the model for
    the cores (bench/throughput.py).
    """

    TRIES = 10  # like torchvision: then fall back to a center crop

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
    ):
        self.size, self.scale, self.hflip = size, scale, hflip
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.ratio = ratio

    def __call__(self, image: Image.Image | torch.Tensor) -> torch.Tensor:
        if isinstance(image, Image.Image):
            image = v2.functional.pil_to_tensor(image)
        height, width = image.shape[-2:]
        uniforms = torch.rand(2 * self.TRIES + 3).tolist()
        top, left, h, w = self.crop_box(height, width, uniforms)
        crop = image[None, :, top : top + h, left : left + w].float()
        out = torch.nn.functional.interpolate(
            crop, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False
        )[0]
        if uniforms[-1] < self.hflip:
            out = out.flip(-1)
        return out.round_().clamp_(0, 255).to(torch.uint8)

    def crop_box(self, height: int, width: int, u: list[float]) -> tuple[int, int, int, int]:
        """torchvision's RandomResizedCrop.get_params, fed with uniforms in [0, 1)."""
        area = height * width
        for t in range(self.TRIES):
            target = area * (self.scale[0] + u[2 * t] * (self.scale[1] - self.scale[0]))
            aspect = math.exp(
                self.log_ratio[0] + u[2 * t + 1] * (self.log_ratio[1] - self.log_ratio[0])
            )
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(u[-3] * (height - h + 1)), int(u[-2] * (width - w + 1)), h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = height, int(round(height * self.ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


def build_transforms(
    image_size: int,
    train: bool,
    crop_scale_min: float = 0.08,
    hflip: float = 0.5,
    *,
    eval_resize_ratio: float = EVAL_RESIZE_RATIO,
    auto_augment: str = "none",
    random_erasing: float = 0.0,
) -> v2.Compose | RandomResizedCropFlip:
    """Per-sample augmentation on uint8 images. Conversion to float and normalization happen once
    per batch in ``collate_normalized``: cheaper than per sample, and 4x fewer bytes between
    processes.

    Training: the crop and flip, then ``auto_augment``'s policy, then random erasing, in the
    order of torchvision's reference recipe. Every random number comes from torch's CPU
    generator, which ``SeededImageDataset`` seeds per sample; the images may be CPU or CUDA
    tensors (``--cache_images gpu``). Evaluation resizes the short side to ``eval_resize_side``
    and crops the centre."""
    if train:
        crop = RandomResizedCropFlip(image_size, scale=(crop_scale_min, 1.0), hflip=hflip)
        extra = image_augmentations(auto_augment, random_erasing)
        return v2.Compose([crop, *extra]) if extra else crop
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(eval_resize_side(image_size, eval_resize_ratio), antialias=True),
            v2.CenterCrop(image_size),
        ]
    )


def eval_resize_side(image_size: int, ratio: float = EVAL_RESIZE_RATIO) -> int:
    """The short side evaluation resizes to before its centre crop of ``image_size``."""
    return int(math.ceil(image_size / ratio))


AUTO_AUGMENT = {
    "trivialaugment": v2.TrivialAugmentWide,
    "randaugment": v2.RandAugment,  # torchvision's defaults: 2 ops at magnitude 9 of 31
}


def image_augmentations(auto_augment: str = "none", random_erasing: float = 0.0) -> list:
    """The per-image augmentations after the crop and flip (``--auto_augment``,
    ``--random_erasing``), as torchvision v2 transforms on uint8 tensors."""
    transforms = []
    if auto_augment != "none":
        transforms.append(AUTO_AUGMENT[auto_augment]())
    if random_erasing > 0:
        # torchvision's recipe erases after normalization with 0, i.e. with the mean colour;
        # here the images are still uint8, so the rectangle gets the mean colour in 0..255.
        mean_colour = [round(255 * m) for m in IMAGENET_MEAN]
        transforms.append(v2.RandomErasing(p=random_erasing, value=mean_colour))
    return transforms


def normalize_batch(
    images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> torch.Tensor:
    """uint8 (N, 3, H, W) in 0..255 -> float32, normalized with ``mean`` and ``std``."""
    mean_t = torch.tensor(mean, device=images.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=images.device).view(1, 3, 1, 1)
    return images.float().div_(255).sub_(mean_t).div_(std_t)


def collate_normalized(
    batch: list[tuple[torch.Tensor, int]],
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = default_collate(batch)
    return normalize_batch(images, mean, std), labels


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of one sample: a function of (seed, epoch, index) only."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + index) % (2**63)


class SeededImageDataset(Dataset):
    """An ImageFolder whose items are fetched by ``(index, epoch)`` keys from ``EpochSampler``.

    The transform runs with the CPU generator seeded from (seed, epoch, index) and restored
    afterwards, so the augmentation of a sample is the same in any worker and the process's own
    random stream (used by dropout, for instance) is untouched. Plain integer keys (validation) use no seeding.
    """

    def __init__(
        self, folder: datasets.ImageFolder | DecodedImageCache, transform: v2.Compose, seed: int
    ):
        self.folder = folder
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        if isinstance(key, int):
            image, label = self.folder[key]
            return self.transform(image), label
        index, epoch = key
        image, label = self.folder[index]
        with seeded_cpu_generator(sample_seed(self.seed, epoch, index)):
            return self.transform(image), label


@contextlib.contextmanager
def seeded_cpu_generator(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator, which the transforms (ours and torchvision's) draw from, and
    put its state back after: what runs inside depends only on ``seed``, and the process's own
    random stream (dropout, for instance) is untouched. (torch.manual_seed and fork_rng would
    also touch every accelerator's generator: ~0.3 ms per sample, more than the augmentation
    itself at small image sizes.)"""
    generator = torch.default_generator
    saved = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(saved)


class DecodedImageCache(Dataset):
    """Every image of a folder decoded once and kept in memory as a uint8 tensor (3, S, W).

    Each image is resized once so its shorter side is S = image_size / ratio (the evaluation
    resize, 0.875 for the training images; aspect ratio kept), so later epochs skip file reads and JPEG decoding and the random
    crop / flip run on small tensors (the transforms accept tensors). Training then crops from
    the resized picture instead of the full-resolution file: the same framing, less detail in
    the smallest crops. With ``device`` "cuda" the images live on the GPU and are augmented
    there. Items are ``(image, label)`` like ImageFolder's.
    """

    def __init__(
        self,
        folder: datasets.ImageFolder,
        image_size: int,
        device: str = "cpu",
        threads: int = 4,
        ratio: float = EVAL_RESIZE_RATIO,
    ):
        side = cache_side(image_size, ratio)
        problems: dict[str, str] = {}  # path -> why it does not decode

        def decode(path: str) -> torch.Tensor | None:
            try:
                image = open_rgb(path, draft=side)  # JPEGs decode at a reduced scale >= side
            except Exception as err:  # any decoder failure on a user's file: leave it out
                text = str(err).splitlines()[0] if str(err) else ""  # as image_problem
                problems[path] = f"{type(err).__name__}: {text}" if text else type(err).__name__
                return None
            scale = side / min(image.size)
            image = image.resize(
                (max(side, round(image.width * scale)), max(side, round(image.height * scale))),
                Image.BILINEAR,
            )
            return v2.functional.pil_to_tensor(image).to(device)

        # Decoding releases the GIL, so threads scale over the cores.
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            decoded = list(pool.map(decode, [path for path, _ in folder.samples]))
        self.images = [image for image in decoded if image is not None]
        self.samples = [
            s for s, image in zip(folder.samples, decoded, strict=True) if image is not None
        ]
        self.targets = [target for _, target in self.samples]
        self.unreadable = problems  # left out here; build_datasets reports them once

    def leave_out(self, paths: set[str]) -> None:
        keep = [i for i, (path, _) in enumerate(self.samples) if path not in paths]
        self.images = [self.images[i] for i in keep]
        self.samples = [self.samples[i] for i in keep]
        self.targets = [target for _, target in self.samples]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], self.targets[index]

    @property
    def nbytes(self) -> int:
        return sum(image.numel() for image in self.images)


def cache_side(image_size: int, ratio: float = EVAL_RESIZE_RATIO) -> int:
    return eval_resize_side(image_size, ratio)


def choose_cache(cache: str, num_images: int, image_size: int, budget_bytes: int) -> str:
    """``auto``: keep decoded images in RAM when they fit the budget (photos taken as 4:3)."""
    if cache != "auto":
        return cache
    estimate = num_images * 3 * cache_side(image_size) ** 2 * 4 // 3
    return "ram" if estimate <= budget_bytes else "none"


# ----------------------------------------------------------------------------- samplers


class EpochSampler(Sampler):
    """This rank's share of a shuffled epoch, as ``(index, epoch)`` keys; resumable by position.

    Like ``DistributedSampler``: the permutation is drawn from a generator seeded with
    seed + epoch (identical on every rank), padded by repeating its head so it divides evenly,
    and rank r takes every world_size-th index. ``set_epoch`` must be called before each epoch,
    otherwise every epoch would see the same order. ``start`` skips the first samples of this
    rank's share by index, without loading them, to continue a run in the middle of an epoch.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int, seed: int):
        self.dataset_size = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.per_rank = math.ceil(num_samples / world_size)
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start

    def indices(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.dataset_size, generator=generator).tolist()
        padding = self.per_rank * self.world_size - self.dataset_size
        order += (order * math.ceil(padding / max(1, len(order))))[:padding]
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in self.indices()[self.start :]:
            yield index, self.epoch

    def __len__(self) -> int:
        return self.per_rank - self.start


class ShardSampler(Sampler):
    """Every world_size-th index from ``rank``, without padding: each validation image is seen by
    exactly one rank, so metrics summed over ranks count it exactly once."""

    def __init__(self, num_samples: int, rank: int, world_size: int):
        self.shard = range(rank, num_samples, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard)

    def __len__(self) -> int:
        return len(self.shard)


# ----------------------------------------------------------------------------- loaders


def default_num_workers(
    cores_per_process: int, device_type: str = "cuda", cached: bool = False
) -> int:
    """Loader workers when the user does not say. With a GPU, up to 4 per process keep it fed.
    On the CPU the model already uses every core: workers only take cores from it, unless
    decoding files makes the data costly; images cached in memory are cheapest to augment in the
    training process itself (measured with bench/throughput.py)."""
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


# ----------------------------------------------------------------------------- unreadable files


class ReadableImageFolder(datasets.ImageFolder):
    """An ImageFolder that reads images as upright RGB, ignores files that are not images, can
    leave out the files found unreadable at start, and never ends an epoch for one bad file.

    ``class_names`` fixes the label of each class folder (a checkpoint's classes, of which the
    folder may hold only some); by default the folder's own visible class folders, sorted.
    """

    def __init__(self, root: Path, class_names: Sequence[str] | None = None):
        self.wanted_classes = list(class_names) if class_names is not None else None
        # allow_empty: an empty class folder is reported by check_no_empty_class, with its name,
        # after the unreadable files are left out too.
        super().__init__(str(root), loader=open_rgb, is_valid_file=is_image_file, allow_empty=True)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        names = self.wanted_classes or find_classes(Path(directory), "image")
        return names, {name: i for i, name in enumerate(names)}

    def leave_out(self, paths: set[str] | dict[str, Any]) -> None:
        self.samples = [s for s in self.samples if s[0] not in paths]
        self.imgs = self.samples
        self.targets = [target for _, target in self.samples]

    def empty_classes(self) -> list[str]:
        """Class folders that exist but hold no usable image."""
        used = set(self.targets)
        return [
            name
            for name, i in self.class_to_idx.items()
            if i not in used and (Path(self.root) / name).is_dir()
        ]

    def __getitem__(self, index: int) -> tuple[Any, int]:
        # A file that passed the start-up check can still fail later (replaced, deleted, a disk
        # error). Hours into a run, one such file must not end it: take the next sample instead.
        for offset in range(len(self.samples)):
            path, target = self.samples[(index + offset) % len(self.samples)]
            try:
                image = self.loader(path)
            except Exception as err:  # any decoder failure on a user's file
                log.warning(
                    f"could not read {path} ({type(err).__name__}: {err}); "
                    "using the next image in its place"
                )
                continue
            return image, target
        raise RuntimeError(f"none of the {len(self.samples)} images under {self.root} can be read")


def leave_out_unreadable(
    folders: dict[str, ReadableImageFolder],
    log_dir: Path | None,
    rank: int = 0,
    world_size: int = 1,
    cache_dir: Path | None = None,
) -> dict[str, str]:
    """Find the files that do not decode, leave them out with one warning (the list goes to
    ``log_dir``), then refuse a class folder left without images; returns ``{path: reason}``
    of the files left out. With ``cache_dir``, results are remembered there per file (see
    ``DecodeCheckCache``). Every rank must call this."""
    paths = [path for folder in folders.values() for path, _ in folder.samples]
    unreadable = find_unreadable_shared(paths, rank, world_size, cache_dir)
    if unreadable:
        report_unreadable(unreadable, len(paths), log_dir)
    for role, folder in folders.items():
        folder.leave_out(unreadable)
        check_no_empty_class(folder, role)
    return unreadable


def find_unreadable_shared(
    paths: list[str], rank: int, world_size: int, cache_dir: Path | None = None
) -> dict[str, str]:
    """Each rank checks every world_size-th file, in its share of the cores (torch's thread count,
    which distributed.setup_distributed sets); the results are gathered so that every rank leaves
    out exactly the same files: the samplers index the same list on every rank. Files whose
    result ``cache_dir`` remembers are not decoded again."""
    cache = DecodeCheckCache(cache_dir)
    todo = cache.unknown(paths)
    if world_size > 1:
        # Ranks on other nodes may remember other files (their own log folder): check every file
        # that any rank lacks, so each rank learns every result and the shares line up.
        todo = sorted(set().union(*all_gather_objects(todo)))
    found = find_unreadable(todo[rank::world_size], workers=torch.get_num_threads())
    if world_size > 1:
        found = {path: why for part in all_gather_objects(found) for path, why in part.items()}
    if todo:
        cache.remember(todo, found)
    return {path: why for path in paths if (why := cache.problem(path)) is not None}


class DecodeCheckCache:
    """What the decode check found for each file, keyed by (path, size, modification time), kept
    in ``folder/image_check_cache.json``. Decoding every image at every start took seconds on a
    large folder; a file that changes gets a new size or time and is checked again.

    It lives in the run's log folder, which is writable by definition (a dataset may sit on a
    read-only share) and goes away with the run's logs. Every rank writes the same content,
    through its own temporary file renamed into place, like the unreadable-files list. Without a
    folder it remembers nothing.
    """

    NAME = "image_check_cache.json"
    VERSION = 1  # bump when the check itself changes: old results are then ignored

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.stats: dict[str, list[int]] = {}
        self.results: dict[str, list] = {}  # path -> [size, mtime_ns, problem or None]
        if folder is not None:
            try:
                saved = json.loads((folder / self.NAME).read_text())
                if saved.get("version") == self.VERSION:
                    self.results = dict(saved["files"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # no cache yet, or a damaged one: check every file again

    def _stat(self, path: str) -> list[int]:
        if path not in self.stats:
            try:
                st = os.stat(path)
                self.stats[path] = [st.st_size, st.st_mtime_ns]
            except OSError:
                self.stats[path] = [-1, -1]
        return self.stats[path]

    def unknown(self, paths: list[str]) -> list[str]:
        if self.folder is None:
            return list(paths)
        return [p for p in paths if p not in self.results or self.results[p][:2] != self._stat(p)]

    def remember(self, checked: list[str], problems: dict[str, str]) -> None:
        for path in checked:
            self.results[path] = [*self._stat(path), problems.get(path)]
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{self.NAME}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"version": self.VERSION, "files": self.results}))
            os.replace(tmp, self.folder / self.NAME)
        except OSError as err:  # only a cache: the next start checks again
            log.warning(f"could not write {self.folder / self.NAME} ({err})")

    def problem(self, path: str) -> str | None:
        if path in self.results:
            return self.results[path][2]
        return None


def report_unreadable(unreadable: dict[str, str], total: int, log_dir: Path | None) -> None:
    if log_dir is not None:
        where = f"list in {write_unreadable_list(unreadable, log_dir)}"
    else:
        shown = sorted(unreadable)[:3]
        where = ", ".join(shown) + (", ..." if len(unreadable) > len(shown) else "")
    log.warning(
        f"{len(unreadable)} of {total} image files cannot be decoded and are left out ({where})"
    )


def check_no_empty_class(folder: ReadableImageFolder, role: str) -> None:
    empty = folder.empty_classes()
    if empty:
        raise UserError(
            f"{role} folder {folder.root}: class folder(s) {', '.join(empty)} hold no "
            f"readable image ({'/'.join(IMAGE_EXTENSIONS)} files that decode); add "
            "images or remove the folder"
        )

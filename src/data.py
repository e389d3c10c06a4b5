"""Datasets, transforms, samplers and loaders, and the checks on the data folders.

Two properties make a run reproducible and resumable at any step:

* the order of training samples is a pure function of (seed, epoch): ``EpochSampler`` shuffles
  with a generator seeded from both, like ``DistributedSampler``;
* each sample's random augmentation is seeded from (seed, epoch, index), never from the loader
  worker that happened to handle it, so results do not change with ``--num_workers``.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import datasets
from torchvision.transforms import v2

from errors import UserError

log = logging.getLogger("trainer")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_RESIZE_RATIO = 0.875  # resize to size/0.875, then center-crop to size (the usual 224/256)


# ----------------------------------------------------------------------------- folder checks

def find_classes(folder: Path, role: str) -> list[str]:
    """Class folder names of an ImageFolder, or one clear error."""
    if not folder.is_dir():
        raise UserError(f"{role} folder {folder} does not exist")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise UserError(f"{role} folder {folder} has no class folders; expected "
                        f"{folder}/<class>/<image files>")
    return classes


def check_data_folders(train_dir: Path, val_dir: Path) -> list[str]:
    """The class names shared by both folders; any problem is one line naming the fix."""
    if not train_dir.exists() and not val_dir.exists():
        raise UserError(
            f"no dataset found: looked for {train_dir.resolve()} and {val_dir.resolve()}. "
            "Try the bundled demo with `python launch_ddp.py --demo`, or put your images in "
            f"{train_dir}/<class>/*.jpg and {val_dir}/<class>/*.jpg "
            "(or point --train_dir/--val_dir at them)")
    train_classes = find_classes(train_dir, "training")
    val_classes = find_classes(val_dir, "validation")
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))
        only_val = sorted(set(val_classes) - set(train_classes))
        raise UserError(f"the class folders of {train_dir} and {val_dir} differ: "
                        f"missing in validation: {only_train or 'none'}; "
                        f"missing in training: {only_val or 'none'}")
    return train_classes


# ----------------------------------------------------------------------------- transforms

def build_transforms(image_size: int, train: bool, crop_scale_min: float = 0.08,
                     hflip: float = 0.5) -> v2.Compose:
    if train:
        geometry = [v2.RandomResizedCrop(image_size, scale=(crop_scale_min, 1.0), antialias=True),
                    v2.RandomHorizontalFlip(hflip)]
    else:
        geometry = [v2.Resize(int(math.ceil(image_size / EVAL_RESIZE_RATIO)), antialias=True),
                    v2.CenterCrop(image_size)]
    return v2.Compose([v2.ToImage(), *geometry, v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of one sample: a function of (seed, epoch, index) only."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + index) % (2**63)


class SeededImageDataset(Dataset):
    """An ImageFolder whose items are fetched by ``(index, epoch)`` keys from ``EpochSampler``.

    The transform runs under a torch RNG seeded from (seed, epoch, index) inside ``fork_rng``, so
    the augmentation of a sample is the same in any worker and the process's own RNG (used by
    dropout, for instance) is untouched. Plain integer keys (validation) use no seeding.
    """

    def __init__(self, folder: datasets.ImageFolder, transform: v2.Compose, seed: int):
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
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, index))
            return self.transform(image), label



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
        return order[self.rank::self.world_size]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in self.indices()[self.start:]:
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

def default_num_workers(cores_per_process: int) -> int:
    return max(0, min(4, cores_per_process))


def make_loader(dataset: Dataset, sampler: Sampler, batch_size: int, *, train: bool,
                num_workers: int, pin_memory: bool, prefetch_factor: int = 2) -> DataLoader:
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
        pin_memory=pin_memory, drop_last=train,
        # Workers live across epochs: no re-fork (and re-import) cost at every epoch start.
        persistent_workers=num_workers > 0,
        # Batches each worker prepares ahead; each one waits in (pinned) host memory.
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


def build_datasets(train_dir: Path, val_dir: Path, image_size: int, seed: int,
                   crop_scale_min: float, hflip: float
                   ) -> tuple[SeededImageDataset, SeededImageDataset, list[str]]:
    class_names = check_data_folders(train_dir, val_dir)
    train_folder = _image_folder(train_dir, "training")
    val_folder = _image_folder(val_dir, "validation")
    train_set = SeededImageDataset(
        train_folder, build_transforms(image_size, True, crop_scale_min, hflip), seed)
    val_set = SeededImageDataset(val_folder, build_transforms(image_size, False), seed)
    return train_set, val_set, class_names


def _image_folder(folder: Path, role: str) -> datasets.ImageFolder:
    try:
        return datasets.ImageFolder(str(folder))
    except FileNotFoundError as err:  # a class folder without any image file
        raise UserError(f"{role} folder {folder}: {err}") from None

"""Samples by (index, epoch) keys, and ``Source``: what a training sample hands over.

Each sample's draws are seeded by (seed, epoch, index); it hands over the pixels of its crop,
its JPEG bytes, or an index into the device cache, with its sample row and label.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgtrainer.data.host.collate import JpegBytes
from imgtrainer.data.host.image_cache import DecodedImageCache
from imgtrainer.data.host.sample_row import crop_of, set_key, set_whole_crop
from imgtrainer.data.layouts.image_files import nvjpeg_size
from imgtrainer.data.layouts.table import UNREADABLE, TableImages


class Source(enum.StrEnum):
    """Where the training images are, decided once (``choose_source``) when the datasets are
    built and carried by ``TrainingSamples``: what a sample hands over, what the loader
    workers do, and what ``DeviceBatches`` does with a batch follow from it."""

    GPU = "gpu"  # decoded once into one canvas on the training device: samples are its indices
    RAM = "ram"  # decoded once into host memory: samples are pixels
    FILES = "files"  # read and decoded by the loader workers every epoch: samples are pixels
    # Files on CUDA: a JPEG that nvjpeg_size passes comes as its bytes, decoded on the device
    # (JpegDecoder); other files as FILES.
    NVJPEG = "nvjpeg"

    @property
    def workers_decode(self) -> bool:
        """Whether the loader workers read (and mostly decode) files."""
        return self in (Source.FILES, Source.NVJPEG)

    @property
    def host_batches(self) -> bool:
        """Whether batches are made in host memory and copied to the device (pinned on CUDA)."""
        return self is not Source.GPU


def choose_source(cache: str, device: torch.device) -> Source:
    """The source of ``--cache_images`` ``cache`` ("gpu", "ram" or "none") for training on
    ``device``: a cache on the device, or files with JPEGs decoded there, need CUDA."""
    cuda = torch.device(device).type == "cuda"
    if cache == "none":
        return Source.NVJPEG if cuda else Source.FILES
    return Source.GPU if cache == "gpu" and cuda else Source.RAM


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of one sample: a function of (seed, epoch, index) only."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + index) % (2**63)


class SeededImageDataset(Dataset):
    """Images of any layout (``TableImages``, a cache) transformed by ``transform``, fetched
    by ``(index, epoch)`` keys from ``EpochSampler`` or by plain indices (validation).

    A keyed transform runs with the CPU generator seeded from (seed, epoch, index) and
    restored afterwards, so the augmentation of a sample is the same in any worker and the
    process's own random stream (used by dropout, for instance) is untouched. Plain integer
    keys use no seeding."""

    def __init__(self, images: Dataset, transform: v2.Compose, seed: int):
        self.images = images
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        if isinstance(key, int):
            image, label = self.images[key]
            return self.transform(image), label
        index, epoch = key
        image, label = self.images[index]
        with seeded_cpu_generator(sample_seed(self.seed, epoch, index)):
            return self.transform(image), label


class TrainingSamples(Dataset):
    """Training samples by ``(index, epoch)`` keys from ``EpochSampler``, for ``BatchAugment``,
    as their ``source`` hands them over: (uint8 pixels of the sample's crop box, its sample row
    with the box now the whole of those pixels, label); for ``Source.GPU`` (``images`` a
    ``DecodedImageCache`` on the device), (index into its canvas, sample row with the box in
    the cached image, label); for ``Source.NVJPEG``, a JPEG that ``nvjpeg_size`` passes as
    (``JpegBytes``, sample row with the box in the whole image, label), decoded and cropped on
    the device (``JpegDecoder``).

    ``draws`` runs with the CPU generator seeded from (seed, epoch, index) (``draw``), so the
    augmentation of a sample is the same in any worker and on any number of ranks; the
    process's own random stream is untouched."""

    def __init__(
        self,
        images: TableImages | DecodedImageCache | CachedImageSizes,
        draws,
        seed: int,
        source: Source = Source.FILES,
    ):
        sizes_only = isinstance(images, CachedImageSizes)
        cached = sizes_only or isinstance(images, DecodedImageCache)
        if (
            (source is Source.GPU and not cached)
            or (source is Source.NVJPEG and cached)
            or (source is not Source.GPU and sizes_only)
        ):
            raise ValueError(f"images from {source} do not fit a {type(images).__name__}")
        self.images, self.draws, self.seed, self.source = images, draws, seed, source

    @property
    def canvas(self) -> torch.Tensor | None:
        """For ``Source.GPU``, the device canvas the samples index (None in ``for_loader``'s
        copy); else None."""
        return getattr(self.images, "canvas", None) if self.source is Source.GPU else None

    @property
    def targets(self):
        """Each image's label."""
        return self.images.targets

    def for_loader(self) -> TrainingSamples:
        """What the DataLoader and its workers get: for ``Source.GPU``, these samples over
        ``CachedImageSizes`` (the same draws and labels, no reference to the device canvas:
        forked workers must not touch CUDA); otherwise these samples themselves."""
        if self.source is not Source.GPU or isinstance(self.images, CachedImageSizes):
            return self
        sizes = CachedImageSizes(list(self.images.sizes), list(self.images.targets))
        return TrainingSamples(sizes, self.draws, self.seed, self.source)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(
        self, key: tuple[int, int]
    ) -> tuple[torch.Tensor | int | JpegBytes, torch.Tensor, int]:
        if self.source is Source.GPU:
            return self.cached_sample(key)
        if self.source is Source.NVJPEG:
            sample = self.jpeg_sample(key)
            if sample is not None:
                return sample
        return self.pixel_sample(key)

    def draw(self, key: tuple[int, int], height: int, width: int) -> torch.Tensor:
        """The sample row of ``key`` for an image of ``height`` x ``width``: a function of
        (seed, epoch, index) only."""
        index, epoch = key
        with seeded_cpu_generator(sample_seed(self.seed, epoch, index)):
            row = self.draws(height, width)
        set_key(row, key)
        return row

    def cached_sample(self, key: tuple[int, int]) -> tuple[int, torch.Tensor, int]:
        """A sample on the device: (its index into the canvas, its sample row, label); only
        its size is read on the host."""
        index = key[0]
        height, width = self.images.sizes[index]
        return index, self.draw(key, height, width), self.images.targets[index]

    def jpeg_sample(self, key: tuple[int, int]) -> tuple[JpegBytes, torch.Tensor, int] | None:
        """A JPEG the device can decode, as its bytes: (``JpegBytes``, its sample row, label);
        None for any other file, and for one known not to decode (the CPU path gives the next
        image in its place)."""
        index = key[0]
        table = self.images.table
        if self.images.states.array[index] == UNREADABLE:
            return None
        try:
            data = table.read(index)
        except Exception:  # gone or damaged: the CPU path gives the next image in its place
            data = b""
        size = nvjpeg_size(data)
        if size is None:
            return None
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return JpegBytes(raw, key, size), self.draw(key, *size), table.label(index)

    def pixel_sample(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The sample decoded on the CPU: (uint8 pixels of its crop, its sample row, label)."""
        image, label = self.images[key[0]]
        size = (image.height, image.width) if isinstance(image, Image.Image) else image.shape[-2:]
        row = self.draw(key, *size)
        pixels = crop_pixels(image, crop_of(row).tolist(), self.draws.size)
        set_whole_crop(row, *pixels.shape[-2:])  # the pixels handed over are the crop itself
        return pixels, row, label


def crop_pixels(image: Image.Image | torch.Tensor, box: list[int], size: int) -> torch.Tensor:
    """The uint8 pixels (3, h, w) of ``box`` (top, left, height, width) of a decoded image, as
    the CPU path hands them over for an output of ``size``: a crop twice the output size or
    more (large photos) is first shrunk by an integer factor, averaging blocks (PIL's reduce),
    so that the batch canvas stays small; a tensor (a cached image) is only cut."""
    top, left, h, w = box
    if not isinstance(image, Image.Image):
        return image[:, top : top + h, left : left + w]
    factor = shrink_factor(h, w, size)
    area = (left, top, left + w, top + h)
    image = image.reduce(factor, box=area) if factor >= 2 else image.crop(area)
    return v2.functional.pil_to_tensor(image)


# One seeded block at a time per process: on CUDA the JPEG decoder's CPU fallback draws samples
# in the decode-ahead thread while the main thread draws the batch's mixing.
_GENERATOR_LOCK = threading.RLock()


def _new_generator_lock() -> None:
    global _GENERATOR_LOCK
    _GENERATOR_LOCK = threading.RLock()  # a forked worker must not inherit a held lock


os.register_at_fork(after_in_child=_new_generator_lock)


def own_cpu_rng_state() -> torch.Tensor:
    """The process's own CPU generator state, never a sample's seeded one: read while no
    ``seeded_cpu_generator`` block holds the generator (the decode thread may be in one)."""
    with _GENERATOR_LOCK:
        return torch.get_rng_state()


@contextlib.contextmanager
def seeded_cpu_generator(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator, which the transforms (ours and torchvision's) draw from, and
    put its state back after: what runs inside depends only on ``seed``, and the process's own
    random stream (dropout, for instance) is untouched. (torch.manual_seed and fork_rng would
    also touch every accelerator's generator, at a cost per sample above the augmentation's
    own at small image sizes.)"""
    with _GENERATOR_LOCK:
        generator = torch.default_generator
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(saved)


@dataclass(frozen=True)
class CachedImageSizes:
    """What the loader workers need of a device cache (``TrainingSamples.for_loader``): each
    image's (height, width) as stored on the canvas, and its label; no pixels."""

    sizes: list[tuple[int, int]]
    targets: list[int]

    def __len__(self) -> int:
        return len(self.targets)


def shrink_factor(height: int, width: int, size: int) -> int:
    """The integer factor a crop of ``height`` x ``width`` is shrunk by before the resample to
    ``size``, on the device and on the CPU path alike (PIL's ``reduce``; under 2: none): the
    largest that keeps its short side at least ``size``, so the canvas and the resample's taps
    stay small (the shrunk side, rounded up, is at least min(height, width) / factor)."""
    return min(height, width) // size


def shrunk_size(height: int, width: int, size: int) -> tuple[int, int]:
    """The size of a ``height`` x ``width`` crop after ``shrink``."""
    factor = shrink_factor(height, width, size)
    if factor < 2:
        return height, width
    return -(-height // factor), -(-width // factor)

"""Where training images come from: the images of a table (``data.table``), the decoded-image
cache, seeded samples."""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgtrainer.data.cache_fill import decode_resized
from imgtrainer.data.image_files import nvjpeg_size
from imgtrainer.data.jpeg_device import JpegBytes, shrink_factor
from imgtrainer.data.params import crop_of, set_whole_crop
from imgtrainer.data.table import UNREADABLE, ImageTable, TableImages
from imgtrainer.data.transforms import EVAL_RESIZE_RATIO, eval_resize_side
from imgtrainer.distributed import heartbeat
from imgtrainer.errors import UserError, first_line
from imgtrainer.files import format_bytes

log = logging.getLogger(__name__)


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
    """An ImageFolder whose items are fetched by ``(index, epoch)`` keys from ``EpochSampler``.

    The transform runs with the CPU generator seeded from (seed, epoch, index) and restored
    afterwards, so the augmentation of a sample is the same in any worker and the process's own
    random stream (used by dropout, for instance) is untouched. Plain integer keys (validation) use no seeding.
    """

    def __init__(self, folder: TableImages | DecodedImageCache, transform: v2.Compose, seed: int):
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


class TrainingSamples(Dataset):
    """Training samples by ``(index, epoch)`` keys from ``EpochSampler``, for ``BatchAugment``,
    as its ``source`` hands them over: (uint8 pixels of the sample's crop box, its parameters
    with the box now the whole of those pixels, label); for ``Source.GPU`` (``folder`` a
    ``DecodedImageCache`` on the device), (index into its canvas, parameters with the box in
    the cached image, label); for ``Source.NVJPEG``, a JPEG that ``nvjpeg_size`` passes as
    (``JpegBytes``, parameters with the box in the whole image, label), decoded and cropped on
    the device (``JpegDecoder``).

    ``draws`` runs with the CPU generator seeded from (seed, epoch, index), so the augmentation
    of a sample is the same in any worker and on any number of ranks; the process's own random
    stream is untouched."""

    def __init__(
        self,
        folder: TableImages | DecodedImageCache,
        draws,
        seed: int,
        source: Source = Source.FILES,
    ):
        sizes_only = isinstance(folder, CachedImageSizes)
        cached = sizes_only or isinstance(folder, DecodedImageCache)
        if (
            (source is Source.GPU and not cached)
            or (source is Source.NVJPEG and cached)
            or (source is not Source.GPU and sizes_only)
        ):
            raise ValueError(f"images from {source} do not fit a {type(folder).__name__}")
        self.folder, self.draws, self.seed, self.source = folder, draws, seed, source

    @property
    def canvas(self) -> torch.Tensor | None:
        """For ``Source.GPU``, the device canvas the samples index (None in ``for_loader``'s
        copy); else None."""
        return getattr(self.folder, "canvas", None) if self.source is Source.GPU else None

    def for_loader(self) -> TrainingSamples:
        """What the DataLoader and its workers get: for ``Source.GPU``, these samples over
        ``CachedImageSizes`` (the same draws and labels, no reference to the device canvas:
        forked workers must not touch CUDA); otherwise these samples themselves."""
        if self.source is not Source.GPU or isinstance(self.folder, CachedImageSizes):
            return self
        sizes = CachedImageSizes(list(self.folder.sizes), list(self.folder.targets))
        return TrainingSamples(sizes, self.draws, self.seed, self.source)

    def __len__(self) -> int:
        return len(self.folder)

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

    def cached_sample(self, key: tuple[int, int]) -> tuple[int, torch.Tensor, int]:
        """A sample on the device: (its index into the canvas, its parameters, label); only its
        size is read on the host."""
        index, epoch = key
        height, width = self.folder.sizes[index]
        with seeded_cpu_generator(sample_seed(self.seed, epoch, index)):
            return index, self.draws(height, width), self.folder.targets[index]

    def jpeg_sample(self, key: tuple[int, int]) -> tuple[JpegBytes, torch.Tensor, int] | None:
        """A JPEG the device can decode, as its bytes: (``JpegBytes``, its parameters, label);
        None for any other file, and for one known not to decode (the CPU path gives the next
        image in its place)."""
        index, epoch = key
        table = self.folder.table
        label = table.label(index)
        if self.folder.states.array[index] == UNREADABLE:
            return None
        try:
            with heartbeat.reading(table.location(index)):
                data = table.read(index)
        except Exception:  # gone or damaged: the CPU path gives the next image in its place
            data = b""
        size = nvjpeg_size(data)
        if size is None:
            return None
        with seeded_cpu_generator(sample_seed(self.seed, epoch, index)):
            params = self.draws(*size)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return JpegBytes(raw, (index, epoch)), params, label

    def pixel_sample(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The sample decoded on the CPU: (uint8 pixels of its crop, its parameters, label)."""
        index, epoch = key
        image, label = self.folder[index]
        size = (image.height, image.width) if isinstance(image, Image.Image) else image.shape[-2:]
        with seeded_cpu_generator(sample_seed(self.seed, epoch, index)):
            params = self.draws(*size)
        top, left, h, w = crop_of(params).tolist()
        if isinstance(image, Image.Image):
            # A crop twice the output size or more (large photos) is first shrunk by an
            # integer factor, averaging blocks (PIL's reduce): the batch canvas stays small.
            factor = shrink_factor(h, w, self.draws.size)
            box = (left, top, left + w, top + h)
            image = image.reduce(factor, box=box) if factor >= 2 else image.crop(box)
            pixels = v2.functional.pil_to_tensor(image)
        else:
            pixels = image[:, top : top + h, left : left + w]
        set_whole_crop(params, *pixels.shape[-2:])  # the pixels handed over are the crop itself
        return pixels, params, label


# One seeded block at a time per process: on CUDA the JPEG decoder's CPU fallback draws samples
# in the decode-ahead thread while the main thread draws the batch's mixing.
_GENERATOR_LOCK = threading.RLock()


def _new_generator_lock() -> None:
    global _GENERATOR_LOCK
    _GENERATOR_LOCK = threading.RLock()  # a forked worker must not inherit a held lock


os.register_at_fork(after_in_child=_new_generator_lock)


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


# The longest side a device-cached image keeps, as a multiple of its short side: 4:3, the
# widest crop RandomResizedCrop draws (and the canvas the auto estimate assumes).
CANVAS_ASPECT = 4 / 3


def stored_window(height: int, width: int, image_size: int) -> tuple[int, int, int, int]:
    """The part (top, left, h, w) of a decoded image the device canvas keeps: its long side cut
    to ceil(CANVAS_ASPECT x its short side) around the centre (FFCV's max_res idea, by cropping:
    no second resample), so the canvas is at most L x L, L that bound, whatever the aspects.

    The window is placed so that evaluation's centre crop of ``image_size`` is the same pixels
    in it as in the whole image. For training, on an image longer than 4:3 (16:9, panoramas)
    the random-resized crop is drawn in this centre window: the same scales and aspects relative
    to it, so smaller crops in pixels, never the cut ends (16:9 loses 1/4 of its long side, a
    4:1 panorama 2/3), and fewer tries fail into the fallback (the centre 4:3, as before to a
    pixel). Images up to 4:3 are kept whole: their crops do not change."""
    limit = math.ceil(min(height, width) * CANVAS_ASPECT)
    h, w = min(height, limit), min(width, limit)

    def offset(full: int, kept: int) -> int:
        # torchvision's centre-crop anchor, int(round((n - size) / 2)), in the whole and in the kept
        start = int(round((full - image_size) / 2.0)) - int(round((kept - image_size) / 2.0))
        return min(max(0, start), full - kept)

    return offset(height, h), offset(width, w), h, w


def canvas_bytes(sizes: Sequence[tuple[int, int]], image_size: int) -> int:
    """Bytes of the device canvas (num, 3, H, W) for decoded images of ``sizes``, each cut to
    its ``stored_window``: H and W the largest kept height and width."""
    kept = [stored_window(h, w, image_size)[2:] for h, w in sizes]
    if not kept:
        return 0
    return len(kept) * 3 * max(h for h, _ in kept) * max(w for _, w in kept)


def padded_bytes(sizes: Sequence[tuple[int, int]]) -> int:
    """Bytes of a canvas of the whole images: num x 3 x the tallest x the widest."""
    if not sizes:
        return 0
    return len(sizes) * 3 * max(h for h, _ in sizes) * max(w for _, w in sizes)


class DecodedImageCache(Dataset):
    """Every image of a folder decoded once and kept in memory as a uint8 tensor (3, S, W).

    Each image is resized once so its shorter side is S = image_size / ratio (the evaluation
    resize, 0.875 for the training images; aspect ratio kept), so later epochs skip file reads and JPEG decoding and the random
    crop / flip run on small tensors (the transforms accept tensors). Training then crops from
    the resized picture instead of the full-resolution file: the same framing, less detail in
    the smallest crops. Items are ``(image, label)`` like ImageFolder's.

    The images are decoded into host memory. ``pack(device)`` (done here when ``device`` is
    "cuda") then puts them in one padded ``canvas`` (num, 3, H, W) on the device (a batch is
    one ``index_select`` of it), each cut to its ``stored_window`` first: at most L x L,
    L = ceil(4/3 S), whatever the aspects (``canvas_bytes``); ``sizes`` are then the kept ones.
    Check ``canvas_bytes(cache.sizes, image_size)`` against the device's memory before packing.
    """

    def __init__(
        self,
        folder: TableImages,
        image_size: int,
        device: str = "cpu",
        threads: int = 4,
        ratio: float = EVAL_RESIZE_RATIO,
    ):
        side = eval_resize_side(image_size, ratio)
        problems: dict[str, str] = {}  # location -> why it does not decode
        table = folder.table

        def decode(i: int) -> torch.Tensor | None:
            try:
                return decode_resized(table, i, side)
            except Exception as err:  # any decoder failure on a user's file: leave it out
                problems[table.location(i)] = first_line(err)
                return None

        # Decoding releases the GIL, so threads scale over the cores.
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            decoded = list(pool.map(decode, range(len(table))))
        self.image_size = image_size
        self.images = [image for image in decoded if image is not None]
        self.table: ImageTable = table.take([i for i, im in enumerate(decoded) if im is not None])
        self.targets = self.table.labels.tolist()
        self.unreadable = problems  # left out here; build_datasets reports them once
        self.sizes = [tuple(image.shape[-2:]) for image in self.images]
        self.canvas: torch.Tensor | None = None  # pack() puts the images in one
        if torch.device(device).type == "cuda":
            self.pack(device)

    def pack(self, device: str | torch.device) -> None:
        """Copy each image's ``stored_window`` into one padded canvas on ``device``, image by
        image from host memory (no second copy of the images on the device); the images
        become views of it and ``sizes`` the kept sizes."""
        if not self.images:
            return
        windows = [stored_window(h, w, self.image_size) for h, w in self.sizes]
        height = max(h for _, _, h, _ in windows)
        width = max(w for _, _, _, w in windows)
        canvas = torch.zeros(len(self.images), 3, height, width, dtype=torch.uint8, device=device)
        for n, (image, (top, left, h, w)) in enumerate(zip(self.images, windows, strict=True)):
            canvas[n, :, :h, :w] = image[:, top : top + h, left : left + w]
        self.sizes = [(h, w) for _, _, h, w in windows]
        self.images = [canvas[n, :, :h, :w] for n, (h, w) in enumerate(self.sizes)]
        self.canvas = canvas

    def leave_out(self, locations: set[str]) -> None:
        keep = [i for i in range(len(self.table)) if self.table.location(i) not in locations]
        if len(keep) == len(self.table):
            return
        self.images = [self.images[i].clone() for i in keep]
        self.table = self.table.take(keep)
        self.targets = self.table.labels.tolist()
        self.sizes = [self.sizes[i] for i in keep]
        if self.canvas is not None:  # the kept images are whole windows already: pack again
            device = self.canvas.device
            self.canvas = None
            self.pack(device)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], self.targets[index]

    @property
    def nbytes(self) -> int:
        if self.canvas is not None:
            return self.canvas.numel()
        return sum(image.numel() for image in self.images)


# --cache_images auto: the share of the free device memory the GPU cache may take (the model,
# its activations and the batch's float copies need the rest).
GPU_CACHE_SHARE = 0.25


def choose_cache(
    cache: str, num_images: int, image_size: int, budget_bytes: int, device_budget_bytes: int = 0
) -> tuple[str, str]:
    """``auto``: the fastest place the decoded images fit, and why: the device when its padded
    canvas (4:3 photos of both orientations: a square of the longer side) fits
    ``device_budget_bytes``, else RAM when the packed images fit ``budget_bytes``, else none."""
    if cache != "auto":
        return cache, f"--cache_images {cache}"
    side = eval_resize_side(image_size)
    packed = num_images * 3 * side**2 * 4 // 3
    canvas = estimated_canvas_bytes(num_images, image_size)
    if 0 < canvas <= device_budget_bytes:
        return "gpu", (
            f"auto: ~{format_bytes(canvas, 'MiB', 0)} fit in {GPU_CACHE_SHARE:.0%} of the free device "
            "memory"
        )
    if packed <= budget_bytes:
        where = "; too large for the device" if device_budget_bytes else ""
        return "ram", f"auto: ~{format_bytes(packed, 'MiB', 0)} fit in the RAM budget{where}"
    return "none", f"auto: ~{format_bytes(packed, 'MiB', 0)} do not fit in the RAM budget"


def estimated_canvas_bytes(num_images: int, image_size: int) -> int:
    """The device canvas ``choose_cache`` assumes before decoding: every image at the training
    cache's side S, a square of ceil(4/3 S) (4:3 photos of both orientations)."""
    return num_images * 3 * math.ceil(eval_resize_side(image_size) * CANVAS_ASPECT) ** 2


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

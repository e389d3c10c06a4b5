"""Decoded images kept in memory: the RAM cache and the GPU cache's images.

Both keep each image resized once by ``decode_resized`` (a sample is the same from a file or a
cache): ``SharedImageCache`` fills as the first epoch reads its images, in memory shared with
the loader workers (``--cache_images ram``); ``DecodedImageCache`` decodes every image up front
and packs them into one canvas on the device (``--cache_images gpu``).
"""

from __future__ import annotations

import logging
import math
import mmap
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgtrainer.data.host.transforms import EVAL_RESIZE_RATIO, eval_resize_side
from imgtrainer.data.layouts.table import ImageTable, ReadStates
from imgtrainer.errors import first_line
from imgtrainer.files import format_bytes

log = logging.getLogger(__name__)


def decode_resized(table: ImageTable, index: int, side: int) -> torch.Tensor:
    """Image ``index`` of ``table`` as uint8 (3, H, W), resized so its shorter side is ``side``
    (aspect kept; smaller images are enlarged): what the image caches keep of each image."""
    image = table.open_rgb(index, draft=side)  # JPEGs decode at a reduced scale >= side
    scale = side / min(image.size)
    image = image.resize(
        (max(side, round(image.width * scale)), max(side, round(image.height * scale))),
        Image.BILINEAR,
    )
    return v2.functional.pil_to_tensor(image)


EMPTY, WRITING, FILLED = 0, 1, 2  # the state of one image's slot


class SharedImageCache(Dataset):
    """The images of ``table``, each decoded by
    ``decode_resized`` when first asked for and kept in an arena of ``capacity`` bytes of
    memory shared with the loader workers forked after it is made (an anonymous shared
    mapping: its pages are taken as images are written, not up front). Items are
    ``(image, label)`` like ImageFolder's; a cached image is a view of the arena.

    Slots are claimed under one lock (the bump of the arena's end); the pixels are written
    outside it and the slot marked filled last, so a reader never sees a half-written image.
    Images that no longer fit are decoded from their file every time: the same pixels."""

    def __init__(
        self,
        table: ImageTable,
        image_size: int,
        capacity: int,
        ratio: float = EVAL_RESIZE_RATIO,
        states: ReadStates | None = None,
    ):
        self.table = table
        self.states = states or ReadStates(len(table))  # shared with the table's dataset
        self.targets = table.labels
        self.side = eval_resize_side(image_size, ratio)
        self.capacity = max(0, capacity)
        n = len(table)
        # Index: the arena's end (1 int64), offsets (int64), heights, widths (int32), states.
        self._index = mmap.mmap(-1, 8 + 16 * n + n + 1)
        view = memoryview(self._index)
        self._end = view[:8].cast("q")
        self._offsets = view[8 : 8 + 8 * n].cast("q")
        self._heights = view[8 + 8 * n : 8 + 12 * n].cast("i")
        self._widths = view[8 + 12 * n : 8 + 16 * n].cast("i")
        self._states = view[8 + 16 * n : 8 + 17 * n]
        self._arena = mmap.mmap(-1, max(1, self.capacity))
        self.pixels = torch.frombuffer(self._arena, dtype=torch.uint8)
        self._lock = multiprocessing.get_context("fork").Lock()

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        # An image that does not decode gives the next one in its place, as from the files.
        read, image = self.states.read_or_next(index, self.image, self.table.location)
        return image, int(self.targets[read])

    def image(self, index: int) -> torch.Tensor:
        """Image ``index`` from the arena, else decoded (and kept, while it fits)."""
        cached = self.cached(index)
        if cached is not None:
            return cached
        image = decode_resized(self.table, index, self.side)
        self.keep(index, image)
        return image

    def cached(self, index: int) -> torch.Tensor | None:
        """The image at ``index`` from the arena, or None while it is not there."""
        if self._states[index] != FILLED:
            return None
        start, h, w = self._offsets[index], self._heights[index], self._widths[index]
        return self.pixels[start : start + 3 * h * w].view(3, h, w)

    def keep(self, index: int, image: torch.Tensor) -> bool:
        """Store ``image`` as the image at ``index`` unless it is there (or being written) or
        the arena is full; whether it was stored."""
        size = image.numel()
        with self._lock:
            start = self._end[0]
            if self._states[index] != EMPTY or start + size > self.capacity:
                return False
            self._states[index] = WRITING
            self._end[0] = start + size
        self.pixels[start : start + size].copy_(image.reshape(-1))
        self._offsets[index] = start
        self._heights[index], self._widths[index] = image.shape[-2:]
        self._states[index] = FILLED
        return True

    @property
    def filled(self) -> int:
        """How many images the arena holds."""
        return self._states.tobytes().count(FILLED)

    @property
    def nbytes(self) -> int:
        return self._end[0]

    def reference(self) -> ResizedImages:
        """Its images as the data audit makes them again: decoded from their files, not read
        from the shared memory."""
        return ResizedImages(self.table, self.side, states=self.states)

    def describe(self) -> str:
        return (
            f"{self.filled} of {len(self)} images in shared memory "
            f"({format_bytes(self.nbytes, 'MiB', 0)} of {format_bytes(self.capacity, 'MiB', 0)})"
        )


def shared_caches(
    images: dict, image_size: int, capacity: int, ratios: dict[str, float]
) -> dict[str, SharedImageCache]:
    """One ``SharedImageCache`` per dataset (a ``TableImages``, whose read states it shares),
    ``capacity`` bytes shared out in proportion to their numbers of images; ``ratios``: each
    dataset's resize ratio."""
    total = max(1, sum(len(dataset) for dataset in images.values()))
    return {
        role: SharedImageCache(
            dataset.table,
            image_size,
            capacity * len(dataset) // total,
            ratios[role],
            dataset.states,
        )
        for role, dataset in images.items()
    }


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
    4:1 panorama 2/3), and fewer tries fail into the fallback (the centre 4:3: the same pixels
    as on the whole image). Images up to 4:3 are kept whole: their crops do not change."""
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


class DecodedImageCache(Dataset):
    """Every image of a table decoded once and kept in memory as a uint8 tensor (3, S, W).

    Each image is resized once so its shorter side is S = image_size / ratio (the evaluation
    resize, 0.875 for the training images; aspect ratio kept), so later epochs skip file reads
    and JPEG decoding and the random crop / flip run on small tensors. Training then crops from
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
        table: ImageTable,
        image_size: int,
        device: str = "cpu",
        threads: int = 4,
        ratio: float = EVAL_RESIZE_RATIO,
    ):
        side = eval_resize_side(image_size, ratio)
        problems: dict[int, str] = {}  # row of ``table`` -> why it does not decode

        def decode(i: int) -> torch.Tensor | None:
            try:
                return decode_resized(table, i, side)
            except Exception as err:  # any decoder failure on a user's file: leave it out
                problems[i] = first_line(err)
                return None

        # Decoding releases the GIL, so threads scale over the cores.
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            decoded = list(pool.map(decode, range(len(table))))
        self.image_size, self.side = image_size, side
        self.images = [image for image in decoded if image is not None]
        self.table: ImageTable = table.take([i for i, im in enumerate(decoded) if im is not None])
        self.targets = self.table.labels.tolist()
        self.unreadable = problems  # rows of the given table, left out here; reported once
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

    def reference(self) -> ResizedImages:
        """Its images as the data audit makes them again: decoded from their files and cut to
        the window the device canvas keeps."""
        return ResizedImages(self.table, self.side, window_for=self.image_size)

    @property
    def nbytes(self) -> int:
        if self.canvas is not None:
            return self.canvas.numel()
        return sum(image.numel() for image in self.images)


class ResizedImages(Dataset):
    """The images of ``table`` as a cache keeps them, decoded again from their files at every
    read: ``decode_resized`` to ``side``, then, for the device canvas, cut to its
    ``stored_window`` for ``window_for`` (the output size). The reference the data audit
    checks a cache's samples against. An image that does not decode gives the next one."""

    def __init__(
        self,
        table: ImageTable,
        side: int,
        window_for: int | None = None,
        states: ReadStates | None = None,
    ):
        self.table, self.side, self.window_for = table, side, window_for
        self.states = states or ReadStates(len(table))

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        read, image = self.states.read_or_next(index, self.image, self.table.location)
        return image, self.table.label(read)

    def image(self, index: int) -> torch.Tensor:
        image = decode_resized(self.table, index, self.side)
        if self.window_for is None:
            return image
        top, left, h, w = stored_window(*image.shape[-2:], self.window_for)
        return image[:, top : top + h, left : left + w]

"""The RAM image cache that fills while the first epoch runs: whoever decodes an image for a step
(the training process or a loader worker) keeps it in memory shared by all of them.

The cached pixels are those of ``decode_resized``, which a cache miss decodes too: a sample
is the same from the file or from the cache, in any epoch, on a resume, at any fill level.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from imgtrainer.data.table import ImageTable, ReadStates
from imgtrainer.data.transforms import EVAL_RESIZE_RATIO, eval_resize_side
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

    def describe(self) -> str:
        return (
            f"{self.filled} of {len(self)} images in shared memory "
            f"({format_bytes(self.nbytes, 'MiB', 0)} of {format_bytes(self.capacity, 'MiB', 0)})"
        )


def shared_caches(
    folders: dict, image_size: int, capacity: int, ratios: dict[str, float]
) -> dict[str, SharedImageCache]:
    """One ``SharedImageCache`` per folder (a ``TableImages``, whose read states it shares),
    ``capacity`` bytes shared out in proportion to their numbers of images; ``ratios``: each
    folder's resize ratio."""
    total = max(1, sum(len(folder) for folder in folders.values()))
    return {
        role: SharedImageCache(
            folder.table, image_size, capacity * len(folder) // total, ratios[role], folder.states
        )
        for role, folder in folders.items()
    }

"""Samples to a batch in a loader worker, and evaluation images normalised as they are collated.

Training samples become a ragged buffer of their pixels, device-cache indices, or an
``EncodedBatch`` with JPEG bytes for the device decoder, each with their sample rows and labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils.data import default_collate

from imgtrainer.data.host.ragged import Ragged
from imgtrainer.data.host.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize_batch


@dataclass(frozen=True)
class JpegBytes:
    """One sample's JPEG file, undecoded: its bytes (uint8, 1-D), its (index, epoch) key, with
    which the CPU path can make the sample again, and its (height, width) from its header."""

    data: torch.Tensor
    key: tuple[int, int]
    size: tuple[int, int]


@dataclass(frozen=True)
class EncodedBatch:
    """A collated batch with JPEG bytes in it: ``pixels`` holds the CPU-decoded samples (at
    ``pixel_positions`` in the batch) as ``collate_samples`` packs them; the JPEGs (at
    ``jpeg_positions``) are one tensor of their bytes end to end (``data``, each ending at its
    ``ends`` entry), so a batch crosses from its worker as a few tensors, not one per file."""

    pixels: Ragged | None
    pixel_positions: list[int]
    data: torch.Tensor
    ends: list[int]
    keys: list[tuple[int, int]]
    sizes: list[tuple[int, int]]
    jpeg_positions: list[int]

    @staticmethod
    def of(
        pixels: Ragged | None, pixel_positions: list[int], jpegs: list[JpegBytes], at: list[int]
    ) -> EncodedBatch:
        data = torch.cat([jpeg.data for jpeg in jpegs])
        ends = torch.tensor([len(jpeg.data) for jpeg in jpegs]).cumsum(0).tolist()
        keys, sizes = [jpeg.key for jpeg in jpegs], [jpeg.size for jpeg in jpegs]
        return EncodedBatch(pixels, pixel_positions, data, ends, keys, sizes, at)

    @property
    def jpegs(self) -> list[JpegBytes]:
        """Each JPEG as its own ``JpegBytes``, its bytes a view of ``data``."""
        starts = [0, *self.ends[:-1]]
        return [
            JpegBytes(self.data[start:end], key, size)
            for start, end, key, size in zip(starts, self.ends, self.keys, self.sizes, strict=True)
        ]

    def pin_memory(self) -> EncodedBatch:  # the DataLoader's pin_memory calls this
        if self.pixels is None:
            return self
        return replace(self, pixels=self.pixels.pin_memory())


def collate_samples(
    batch: list[tuple[torch.Tensor | int | JpegBytes, torch.Tensor, int]],
) -> tuple[torch.Tensor | EncodedBatch, torch.Tensor, torch.Tensor]:
    """Samples -> (pixels, sample rows, labels): the samples' uint8 pixels packed as ``Ragged``
    (only their bytes cross to the device, where ``as_canvas`` lays them on a canvas), or, for
    images cached on the device, their indices into the cache; a batch with JPEG bytes in it
    (decoded on the device) is an ``EncodedBatch`` holding its other samples packed and the
    bytes."""
    pixels, rows, labels = zip(*batch, strict=True)
    labels_t = torch.tensor(labels, dtype=torch.int64)
    rows_t = torch.stack(rows)
    if isinstance(pixels[0], int):
        return torch.tensor(pixels, dtype=torch.int64), rows_t, labels_t
    pixel_at, jpeg_at = split_samples(pixels)
    if jpeg_at:
        packed = Ragged.of([pixels[n] for n in pixel_at]) if pixel_at else None
        jpegs = [pixels[n] for n in jpeg_at]
        return EncodedBatch.of(packed, pixel_at, jpegs, jpeg_at), rows_t, labels_t
    return Ragged.of(pixels), rows_t, labels_t


def split_samples(pixels: Sequence[torch.Tensor | JpegBytes]) -> tuple[list[int], list[int]]:
    """The batch positions of decoded pixels and those of JPEG bytes."""
    jpeg_at = [n for n, p in enumerate(pixels) if isinstance(p, JpegBytes)]
    taken = set(jpeg_at)
    return [n for n in range(len(pixels)) if n not in taken], jpeg_at


def collate_normalized(
    batch: list[tuple[torch.Tensor, int]],
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation samples -> (normalised float32 images, labels)."""
    images, labels = default_collate(batch)
    return normalize_batch(images, mean, std), labels

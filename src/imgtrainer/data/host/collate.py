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
    """One sample's JPEG file, undecoded: its bytes (uint8, 1-D) and its (index, epoch) key,
    with which the CPU path can make the sample again."""

    data: torch.Tensor
    key: tuple[int, int]


@dataclass(frozen=True)
class EncodedBatch:
    """A collated batch with JPEG bytes in it: ``pixels`` holds the CPU-decoded samples (at
    ``pixel_positions`` in the batch) as ``collate_samples`` packs them, ``jpegs`` the others
    (at ``jpeg_positions``)."""

    pixels: Ragged | None
    pixel_positions: list[int]
    jpegs: list[JpegBytes]
    jpeg_positions: list[int]

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
        return EncodedBatch(packed, pixel_at, jpegs, jpeg_at), rows_t, labels_t
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

"""JPEG files decoded on the training device: loader workers hand over a JPEG's raw bytes
(``JpegBytes``) with the parameters drawn for its header size; ``JpegDecoder`` decodes a batch's
JPEGs in one ``decode_jpeg`` call on the device, crops each to its box (shrunk like the CPU path's
PIL ``reduce``) and places them with the batch's CPU-decoded samples on one canvas. What the
device decoder fails on is decoded on the CPU exactly as the CPU path does it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from imgtrainer.data.params import crop_of, crop_size_of, set_whole_crop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JpegBytes:
    """One sample's JPEG file, undecoded: its bytes (uint8, 1-D) and its (index, epoch) key,
    with which the CPU path can make the sample again."""

    data: torch.Tensor
    key: tuple[int, int]


@dataclass(frozen=True)
class EncodedBatch:
    """A collated batch with JPEG bytes in it: ``canvas`` holds the CPU-decoded samples (rows
    ``pixel_rows`` of the batch) as ``collate_samples`` pads them, ``jpegs`` the others (rows
    ``jpeg_rows``)."""

    canvas: torch.Tensor | None
    pixel_rows: list[int]
    jpegs: list[JpegBytes]
    jpeg_rows: list[int]

    def pin_memory(self) -> EncodedBatch:  # the DataLoader's pin_memory calls this
        if self.canvas is None:
            return self
        return replace(self, canvas=self.canvas.pin_memory())


def device_decoder(device: torch.device) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """torchvision's batched JPEG decoding on ``device`` (nvjpeg on CUDA), to RGB."""
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(data: list[torch.Tensor]) -> list[torch.Tensor]:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

    return decode


def shrink(crop: torch.Tensor, factor: int) -> torch.Tensor:
    """PIL's ``reduce(factor)`` on the device: the mean of each factor x factor block (the last,
    partial blocks over the pixels they have), rounded to uint8."""
    if factor < 2:
        return crop
    mean = F.avg_pool2d(crop[None].float(), factor, ceil_mode=True)[0]
    return mean.round_().clamp_(0, 255).to(torch.uint8)


class JpegDecoder:
    """(EncodedBatch, params, labels) -> (uint8 canvas on ``device``, params, labels), the
    params' boxes then spanning each sample's pixels as on the CPU path.

    ``decode`` maps a list of JPEG byte tensors to RGB uint8 images on the device (default:
    ``decode_jpeg`` there); when it fails for the batch, each JPEG is tried alone, and one that
    still fails is made by ``fallback(key)`` -> (pixels, params, label), the CPU path with its
    handling of unreadable files. ``size`` is the output size (crops over twice it are shrunk
    by an integer factor first, as the loader workers do)."""

    def __init__(
        self,
        device: torch.device,
        size: int,
        fallback: Callable[[tuple[int, int]], tuple[torch.Tensor, torch.Tensor, int]],
        decode: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ):
        self.device, self.size, self.fallback = torch.device(device), size, fallback
        self.decode = decode or device_decoder(self.device)
        self.enabled = True  # off once the device decoder fails on every image of a batch

    def decode_all(self, data: list[torch.Tensor]) -> list[torch.Tensor | None]:
        if not self.enabled:
            return [None] * len(data)
        try:
            return list(self.decode(data))
        except Exception:  # one bad file fails the whole call: find it alone
            decoded: list[torch.Tensor | None] = []
            error = None
            for one in data:
                try:
                    decoded.append(self.decode([one])[0])
                except Exception as err:  # any decoder failure: the CPU path decides
                    log.debug(f"device JPEG decoding failed ({type(err).__name__}: {err})")
                    decoded.append(None)
                    error = err
            if len(data) > 1 and all(image is None for image in decoded):
                # Not one bad file: the device decoder does not work here (no nvjpeg).
                self.enabled = False
                log.warning(
                    f"JPEG decoding on {self.device} failed for every image of a batch "
                    f"({type(error).__name__}: {error}); decoding on the CPU from here on"
                )
            return decoded

    def __call__(
        self, batch: EncodedBatch, params: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        params, labels = params.clone(), labels.clone()
        pieces: dict[int, torch.Tensor] = {}
        if batch.canvas is not None:
            canvas = batch.canvas.to(self.device, non_blocking=True)
            for i, row in enumerate(batch.pixel_rows):
                h, w = crop_size_of(params[row]).tolist()
                pieces[row] = canvas[i, :, :h, :w]
        decoded = self.decode_all([jpeg.data for jpeg in batch.jpegs])
        for jpeg, row, image in zip(batch.jpegs, batch.jpeg_rows, decoded, strict=True):
            top, left, h, w = crop_of(params[row]).tolist()
            if image is None or image.shape[-2] < top + h or image.shape[-1] < left + w:
                pixels, params[row], labels[row] = self.fallback(jpeg.key)
                pieces[row] = pixels.to(self.device)
                continue
            crop = image[:, top : top + h, left : left + w]
            pieces[row] = shrink(crop, min(h, w) // (2 * self.size))
            set_whole_crop(params[row], *pieces[row].shape[-2:])
        return place(pieces, len(labels), self.device), params, labels


def place(pieces: dict[int, torch.Tensor], count: int, device: torch.device) -> torch.Tensor:
    """Each row's pixels at the top left of one zero canvas as large as the largest."""
    height = max(p.shape[-2] for p in pieces.values())
    width = max(p.shape[-1] for p in pieces.values())
    canvas = torch.zeros(count, 3, height, width, dtype=torch.uint8, device=device)
    for row, p in pieces.items():
        canvas[row, :, : p.shape[-2], : p.shape[-1]] = p
    return canvas


def split_samples(pixels: Sequence[torch.Tensor | JpegBytes]) -> tuple[list[int], list[int]]:
    """The rows of decoded pixels and the rows of JPEG bytes."""
    jpeg_rows = [n for n, p in enumerate(pixels) if isinstance(p, JpegBytes)]
    taken = set(jpeg_rows)
    return [n for n in range(len(pixels)) if n not in taken], jpeg_rows

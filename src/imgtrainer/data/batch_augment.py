"""Training augmentation of whole batches on the training device.

The host draws each sample's parameters (``AugmentDraws``: crop box, flip, erasing rectangle,
the policy's ops) from the generator seeded by (seed, epoch, index); sources hand over uint8
pixels; ``BatchAugment`` then resamples every crop of the batch at once (a gather of a few taps
per output pixel and their weighted sum, columns then rows, with the weights of torch's
antialiased bilinear ``interpolate``; flips folded into them), applies the ``--auto_augment``
policy grouped by op (``data.batch_policy``), normalises and erases, on the batch's device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from imgtrainer.config import TrainConfig
from imgtrainer.data.batch_policy import BatchPolicy, draw_policy
from imgtrainer.data.jpeg_device import EncodedBatch, JpegBytes, JpegDecoder, split_samples
from imgtrainer.data.params import (
    FLIP,
    HEIGHT,
    LEFT,
    NO_ERASE,
    NO_POLICY,
    TOP,
    WIDTH,
    erase_of,
    policy_of,
    row_of,
)
from imgtrainer.data.transforms import IMAGENET_MEAN, IMAGENET_STD

CROP_TRIES = 10  # like torchvision's RandomResizedCrop, then a center crop
ERASE_TRIES = 10  # like torchvision's RandomErasing, then no erasing
ERASE_SCALE = (0.02, 0.33)  # torchvision's RandomErasing defaults
ERASE_RATIO = (0.3, 3.3)


def crop_box(
    height: int,
    width: int,
    u: Sequence[float],
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params as (top, left, h, w), fed with
    2 * CROP_TRIES + 2 uniforms in [0, 1)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for t in range(CROP_TRIES):
        target = area * (scale[0] + u[2 * t] * (scale[1] - scale[0]))
        aspect = math.exp(log_ratio[0] + u[2 * t + 1] * (log_ratio[1] - log_ratio[0]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return (
                int(u[2 * CROP_TRIES] * (height - h + 1)),
                int(u[2 * CROP_TRIES + 1] * (width - w + 1)),
                h,
                w,
            )
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def erase_box(size: int, u: Sequence[float], p: float) -> tuple[int, int, int, int]:
    """torchvision's RandomErasing.get_params on a size x size image as (top, left, h, w), fed
    with 1 + 2 * ERASE_TRIES + 2 uniforms; h = w = 0 when nothing is erased."""
    if u[0] >= p:
        return 0, 0, 0, 0
    log_ratio = (math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1]))
    for t in range(ERASE_TRIES):
        area = size * size * (ERASE_SCALE[0] + u[1 + 2 * t] * (ERASE_SCALE[1] - ERASE_SCALE[0]))
        aspect = math.exp(log_ratio[0] + u[2 + 2 * t] * (log_ratio[1] - log_ratio[0]))
        h = int(round(math.sqrt(area * aspect)))
        w = int(round(math.sqrt(area / aspect)))
        if 0 < h < size and 0 < w < size:
            top = int(u[-2] * (size - h + 1))
            left = int(u[-1] * (size - w + 1))
            return top, left, h, w
    return 0, 0, 0, 0


@dataclass(frozen=True)
class AugmentDraws:
    """The host half: one sample's parameters from torch's CPU generator (which the dataset
    seeds from (seed, epoch, index)), as its row (``data.params``). The crop uses the
    same uniforms, in the same order, as the per-image crop it replaces; then the ``policy``'s
    (``--auto_augment``) ops, with the calls of torchvision's policy."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    hflip: float = 0.5
    random_erasing: float = 0.0
    policy: str = "none"

    def __call__(self, height: int, width: int) -> torch.Tensor:
        u = torch.rand(2 * CROP_TRIES + 3).tolist()
        crop = crop_box(height, width, u[:-1], self.scale)
        policy = draw_policy(self.policy) if self.policy != "none" else NO_POLICY
        erase = NO_ERASE
        if self.random_erasing > 0:
            e = torch.rand(1 + 2 * ERASE_TRIES + 2).tolist()
            erase = erase_box(self.size, e, self.random_erasing)
        return row_of(crop, int(u[-1] < self.hflip), erase, policy)


def resample_taps(start: torch.Tensor, length: torch.Tensor, size: int, taps: int):
    """Where and how much each output pixel reads, for the antialiased bilinear resize of each
    sample's span [start, start + length) of a canvas axis to ``size`` pixels: (N, size, taps)
    canvas indices and float32 weights, the weights of ``interpolate(crop, mode="bilinear",
    antialias=True, align_corners=False)`` (clamped to the crop as it is; 0 past its taps)."""
    start = start.to(torch.float64)[:, None, None]
    length = length.to(torch.float64)[:, None, None]
    scale = length / size
    support = scale.clamp(min=1.0)  # the triangle widens with the downscale factor
    at = torch.arange(size, dtype=torch.float64, device=start.device)[None, :, None]
    center = scale * (at + 0.5)
    low = torch.trunc(center - support + 0.5).clamp(min=0)
    high = torch.minimum(torch.trunc(center + support + 0.5), length)
    x = low + torch.arange(taps, dtype=torch.float64, device=start.device)
    weights = (1 - ((x - center + 0.5) / support).abs()).clamp(min=0) * (x < high)
    weights = weights / weights.sum(-1, keepdim=True)
    return (torch.minimum(x, length - 1) + start).long(), weights.float()


def tap_count(lengths: torch.Tensor, size: int) -> int:
    """Taps enough for every sample: a span of 2 * support + 1 pixels at most."""
    return int(2 * max(float(lengths.max()) / size, 1.0)) + 2


def weighted_taps(images: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Resample dim 1 of the contiguous ``images`` (N, L, M, C): output j of sample n is the sum
    over taps k of weights[n, j, k] * images[n, index[n, j, k]], as float32 (N, size, M, C)."""
    n, length = images.shape[:2]
    size, taps = index.shape[1:]
    flat = images.view(n * length, -1)
    rows = index + length * torch.arange(n, device=index.device)[:, None, None]
    out = torch.zeros(n, size, *images.shape[2:], device=images.device)
    for k in range(taps):  # one tap at a time: whole rows of M x C values, one index_select
        gathered = flat.index_select(0, rows[:, :, k].reshape(-1)).view(out.shape)
        out.addcmul_(gathered, weights[:, :, k, None, None])
    return out


class BatchAugment:
    """The device half: (uint8 pixels (N, 3, H, W), int64 parameters (N, PARAMS)) -> the
    normalised float32 batch (N, 3, size, size), on the pixels' device.

    Each sample's crop box indexes its own image on the canvas (the padding is never read:
    its weights are zero). ``policy`` (TrivialAugment/RandAugment) applies the ops each sample
    drew to the resampled uint8 images, one op at a time for all the samples that drew it."""

    def __init__(
        self,
        size: int,
        policy: BatchPolicy | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ):
        self.size, self.policy = size, policy
        self.mean, self.std = tuple(mean), tuple(std)
        self._normalisers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def normaliser(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and std as (1, 3, 1, 1) tensors on ``device``, copied there once."""
        if device not in self._normalisers:
            self._normalisers[device] = tuple(
                torch.tensor(v, device=device).view(1, 3, 1, 1) for v in (self.mean, self.std)
            )
        return self._normalisers[device]

    def resample(self, pixels: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """Every crop resized to size x size and flipped where drawn: float, 0..255. Each
        output pixel is a weighted sum of a few gathered source pixels, rows then columns.
        ``params`` on the host: the number of taps is read from it without a device sync."""
        size = self.size
        height_taps = tap_count(params[:, HEIGHT], size)
        width_taps = tap_count(params[:, WIDTH], size)
        params = params.to(pixels.device, non_blocking=True)
        index, weights = resample_taps(params[:, LEFT], params[:, WIDTH], size, width_taps)
        flip = params[:, FLIP].bool()[:, None, None]
        index = torch.where(flip, index.flip(1), index)
        weights = torch.where(flip, weights.flip(1), weights)
        # Channels last, so that each gathered tap is a contiguous run of memory.
        across = pixels.permute(0, 3, 2, 1).contiguous()  # (N, W, H, 3)
        columns = weighted_taps(across, index, weights)  # (N, size, H, 3)
        index, weights = resample_taps(params[:, TOP], params[:, HEIGHT], size, height_taps)
        down = columns.transpose(1, 2).contiguous()  # (N, H, size, 3)
        rows = weighted_taps(down, index, weights)  # (N, size, size, 3)
        return rows.permute(0, 3, 1, 2)  # (N, 3, size, size), channels_last in memory

    def __call__(self, pixels: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """The batch's pixels on the training device, its parameters still on the host."""
        images = self.resample(pixels, params)
        if self.policy is not None:  # its choices read on the host: no device sync
            images = images.round_().clamp_(0, 255).to(torch.uint8)
            images = self.policy(images, policy_of(params)).float()
        params = params.to(pixels.device, non_blocking=True)
        mean, std = self.normaliser(images.device)
        images = images.div_(255).sub_(mean).div_(std)
        return erase(images, params)


def erase(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Each sample's erasing rectangle set to 0 (the mean colour after normalisation, as in
    torchvision's recipe); samples with an empty rectangle are untouched."""
    size = images.shape[-1]
    at = torch.arange(size, device=images.device)
    top, left, height, width = erase_of(params)[:, :, None].unbind(1)
    rows = (at >= top) & (at < top + height)  # (N, size)
    cols = (at >= left) & (at < left + width)
    mask = rows[:, None, :, None] & cols[:, None, None, :]
    return images.masked_fill_(mask, 0.0)


def train_augmentation(
    cfg: TrainConfig, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> tuple[AugmentDraws, BatchAugment]:
    """The training augmentation of ``cfg``, the one place that reads the augmentation flags:
    RandomResizedCrop and the flip, then ``--auto_augment``'s policy, then random erasing, in
    the order of torchvision's reference recipe."""
    draws = AugmentDraws(
        cfg.image_size,
        scale=(cfg.crop_scale_min, 1.0),
        hflip=cfg.hflip,
        random_erasing=cfg.random_erasing,
        policy=cfg.auto_augment,
    )
    policy = BatchPolicy(cfg.auto_augment, cfg.image_size) if cfg.auto_augment != "none" else None
    return draws, BatchAugment(cfg.image_size, policy, mean, std)


def collate_samples(
    batch: list[tuple[torch.Tensor | int | JpegBytes, torch.Tensor, int]],
) -> tuple[torch.Tensor | EncodedBatch, torch.Tensor, torch.Tensor]:
    """Samples -> (pixels, params, labels): each sample's uint8 pixels at the top left of a
    canvas as large as the batch's largest (zeros elsewhere), or, for images cached on the
    device, their indices into the cache; a batch with JPEG bytes in it (decoded on the
    device) is an ``EncodedBatch`` holding the canvas of its other samples and the bytes."""
    pixels, params, labels = zip(*batch, strict=True)
    labels_t = torch.tensor(labels, dtype=torch.int64)
    params_t = torch.stack(params)
    if isinstance(pixels[0], int):
        return torch.tensor(pixels, dtype=torch.int64), params_t, labels_t
    pixel_rows, jpeg_rows = split_samples(pixels)
    if jpeg_rows:
        canvas = pad_canvas([pixels[n] for n in pixel_rows]) if pixel_rows else None
        jpegs = [pixels[n] for n in jpeg_rows]
        return EncodedBatch(canvas, pixel_rows, jpegs, jpeg_rows), params_t, labels_t
    return pad_canvas(pixels), params_t, labels_t


def pad_canvas(pixels: Sequence[torch.Tensor]) -> torch.Tensor:
    height = max(p.shape[-2] for p in pixels)
    width = max(p.shape[-1] for p in pixels)
    canvas = torch.zeros(len(pixels), 3, height, width, dtype=torch.uint8)
    for n, p in enumerate(pixels):
        canvas[n, :, : p.shape[-2], : p.shape[-1]] = p
    return canvas


class DeviceBatches:
    """The training loader as the loop sees it: each loaded batch moved to ``device``
    (non-blocking from pinned memory) and augmented there as a whole; batches with JPEG
    bytes are first decoded there by ``jpegs`` (a ``JpegDecoder``). Anything else
    (``dataset``, ``num_workers``, ``sampler``) is the wrapped DataLoader's."""

    def __init__(
        self,
        loader,
        augment: BatchAugment,
        device: torch.device,
        cache=None,
        jpegs: JpegDecoder | None = None,
    ):
        self.loader, self.augment, self.device = loader, augment, torch.device(device)
        self.cache = cache  # the device cache's canvas when the batches are its indices
        self.jpegs = jpegs

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)

    def __iter__(self):
        for pixels, params, labels in self.loader:
            yield self.apply(pixels, params, labels)

    def apply(
        self, pixels: torch.Tensor | EncodedBatch, params: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One collated batch -> (its augmented images, its labels) on the device."""
        if isinstance(pixels, EncodedBatch):  # JPEG bytes: decoded on the device first
            pixels, params, labels = self.jpegs(pixels, params, labels)
        if self.cache is not None:  # indices of images already on the device
            pixels = self.cache.index_select(0, pixels.to(self.device, non_blocking=True))
        else:
            pixels = pixels.to(self.device, non_blocking=True)
        images = self.augment(pixels, params)  # the parameters stay on the host until used
        return images, labels.to(self.device, non_blocking=True)

    def preview(self, keys: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The augmented, normalised images of these (index, epoch) keys, as in training."""
        return self.apply(*collate_samples([self.loader.dataset[key] for key in keys]))[0]

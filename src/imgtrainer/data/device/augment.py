"""The device half of the augmentation: a batch's uint8 pixels and sample rows -> the normalised
batch on the training device. Every crop is resampled at once (a few taps per output pixel with
the weights of torch's antialiased bilinear ``interpolate``, flips folded in: ``resample``), then
the ``--auto_augment`` policy grouped by op (``policy``), normalisation and erasing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch

from imgtrainer.data.device.policy import BatchPolicy
from imgtrainer.data.device.resample import banded_resample, resample_taps, tap_count, weighted_taps
from imgtrainer.data.host.ragged import Ragged, as_canvas
from imgtrainer.data.host.sample_row import FLIP, HEIGHT, LEFT, TOP, WIDTH, erase_of, policy_of
from imgtrainer.data.host.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize_batch
from imgtrainer.precision import FLOAT32, Precision, uses_channels_last
from imgtrainer.torch_compat import tf32_matmuls


class BatchAugment:
    """(uint8 pixels (N, 3, H, W), int64 sample rows (N, ROW_WIDTH)) -> the normalised batch
    (N, 3, size, size) on the pixels' device, in the dtype (``Precision.batch_dtype``) and
    memory layout (``uses_channels_last``) of the model it feeds there.

    Each sample's crop box indexes its own image on the canvas (the padding is never read:
    its weights are zero). ``policy`` (TrivialAugment/RandAugment) applies the ops each sample
    drew to the resampled uint8 images, one op at a time for all the samples that drew it."""

    def __init__(
        self,
        size: int,
        policy: BatchPolicy | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        channels_last: bool = False,
        precision: Precision = FLOAT32,
    ):
        self.size, self.policy = size, policy
        self.mean, self.std = tuple(mean), tuple(std)
        self.channels_last, self.precision = channels_last, precision
        self.banded: bool | None = None  # the resample's form: None, by device (use_bmm)

    def use_bmm(self, device: torch.device) -> bool:
        """The banded-matrix resample (``banded_resample``) on CUDA, unless ``banded`` says;
        the gathered taps elsewhere: the CPU's outputs, bit for bit the reference's."""
        return device.type == "cuda" if self.banded is None else self.banded

    def dtype(self, device: torch.device) -> torch.dtype:
        """The output's dtype on ``device``: the one the model's first layer reads there."""
        return self.precision.batch_dtype(device)

    def layout(self, device: torch.device) -> torch.memory_format:
        """The output's memory layout on ``device``: the one the model is in there."""
        if uses_channels_last(self.channels_last, device):
            return torch.channels_last
        return torch.contiguous_format

    def resample(
        self,
        pixels: torch.Tensor,
        rows: torch.Tensor,
        normalise: bool = False,
        on_device: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every crop resized to size x size and flipped where drawn: float, 0..255 (or
        normalised, where ``normalise`` and the banded form fold it into its weights). Each
        output pixel is a weighted sum of a few source pixels, columns then rows. The sample
        ``rows`` on the host: the number of taps is read from them without a device sync;
        ``on_device``: the same rows on the pixels' device, when already there."""
        size = self.size
        height_taps = tap_count(rows[:, HEIGHT], size)
        width_taps = tap_count(rows[:, WIDTH], size)
        rows = rows.to(pixels.device, non_blocking=True) if on_device is None else on_device
        if self.use_bmm(pixels.device):
            # Normalised: in the output's dtype and layout, one pass; 0..255 stays float32.
            dtype = self.dtype(pixels.device) if normalise else torch.float32
            scale, shift = (
                folded_normaliser(self.mean, self.std, pixels.device) if normalise else (None, None)
            )
            # TF32 where the output is bfloat16 or float16 anyway: pixels are exact in it, the
            # weights' rounding (about 5e-4) far below the output's; float32 for the policy,
            # whose uint8 rounding follows the CPU's.
            reduced = tf32_matmuls() if dtype != torch.float32 else contextlib.nullcontext()
            with reduced:
                images = banded_resample(
                    pixels, rows, size, (height_taps, width_taps), scale, shift
                )
            return images.to(dtype, memory_format=self.layout(pixels.device))
        index, weights = resample_taps(rows[:, LEFT], rows[:, WIDTH], size, width_taps)
        flip = rows[:, FLIP].bool()[:, None, None]
        index = torch.where(flip, index.flip(1), index)
        weights = torch.where(flip, weights.flip(1), weights)
        # Channels last, so that each gathered tap is a contiguous run of memory.
        across = pixels.permute(0, 3, 2, 1).contiguous()  # (N, W, H, 3)
        columns = weighted_taps(across, index, weights)  # (N, size, H, 3)
        index, weights = resample_taps(rows[:, TOP], rows[:, HEIGHT], size, height_taps)
        down = columns.transpose(1, 2).contiguous()  # (N, H, size, 3)
        resized = weighted_taps(down, index, weights)  # (N, size, size, 3)
        # (N, 3, size, size): channels_last in memory as computed, else one copy to NCHW.
        images = resized.permute(0, 3, 1, 2).contiguous(memory_format=self.layout(pixels.device))
        return self.normalise(images).to(self.dtype(pixels.device)) if normalise else images

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """0..255 floats to the normalised ones, in place, as torchvision's Normalize does."""
        return normalize_batch(images, *normaliser(self.mean, self.std, images.device))

    def __call__(self, pixels: torch.Tensor | Ragged, rows: torch.Tensor) -> torch.Tensor:
        """The batch's pixels on the training device, its sample rows still on the host."""
        pixels = as_canvas(pixels)
        on_device = rows.to(pixels.device, non_blocking=True)  # once, for the resample and erasing
        if self.policy is None:
            images = self.resample(pixels, rows, normalise=True, on_device=on_device)
        else:  # its choices read on the host: no device sync
            images = self.resample(pixels, rows, on_device=on_device)
            images = images.round_().clamp_(0, 255).to(torch.uint8)
            images = self.normalise(self.policy(images, policy_of(rows)).float())
            images = images.to(self.dtype(pixels.device))
        return erase(images, on_device)


def erase(images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each sample's erasing rectangle set to 0 (the mean colour after normalisation, as in
    torchvision's recipe); samples with an empty rectangle are untouched."""
    size = images.shape[-1]
    at = torch.arange(size, device=images.device)
    top, left, height, width = erase_of(rows)[:, :, None].unbind(1)
    inside_rows = (at >= top) & (at < top + height)  # (N, size)
    inside_cols = (at >= left) & (at < left + width)
    mask = inside_rows[:, None, :, None] & inside_cols[:, None, None, :]
    return images.masked_fill_(mask, 0.0)


def copied_to(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, copied without the host waiting (from pinned memory on
    CUDA, which the caching host allocator keeps until the copy is done)."""
    if torch.device(device).type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


@functools.cache
def normaliser(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and std as (1, 3, 1, 1) float32 tensors on ``device``, made once."""
    return tuple(copied_to(torch.tensor(v).view(1, 3, 1, 1), device) for v in (mean, std))


@functools.cache
def folded_normaliser(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / 255 - mean) / std as x * scale + shift: (3,) float32 on ``device``, made once
    (from float64: within an ulp or two of the three float32 passes it replaces)."""
    mean64 = torch.tensor(mean, dtype=torch.float64)
    std64 = torch.tensor(std, dtype=torch.float64)
    return copied_to((1 / (255 * std64)).float(), device), copied_to(
        (-mean64 / std64).float(), device
    )

"""The host half of the augmentation: one sample's draws as its sample row.

Its crop box, flip, erasing box and policy ops, drawn from torch's CPU generator with the calls
of torchvision's own transforms, in their order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchvision.transforms import v2

from imgtrainer.data.host.sample_row import (
    NO_ERASE,
    NO_POLICY,
    SLOTS,
    row_of,
    slot_columns,
)
from imgtrainer.data.host.transforms import AUTO_AUGMENT

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
    """One sample's draws from torch's CPU generator (which the dataset seeds from (seed,
    epoch, index)), as its sample row. The crop uses the uniforms of torchvision's
    RandomResizedCrop, in its order; then the ``policy``'s (``--auto_augment``) ops, with the
    calls of torchvision's policy."""

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


# Two torchvision privates, _get_inverse_affine_matrix and the policies' _AUGMENTATION_SPACE, give
# the numbers its per-image ops use (tests/test_batch_policy.py checks them against the installed
# torchvision).
# The ops in the order of both policies' augmentation spaces (the op index is its position).
OPS = (
    *("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"),
    *("Brightness", "Color", "Contrast", "Sharpness", "Posterize", "Solarize"),
    *("AutoContrast", "Equalize"),
)
GEOMETRIC = range(1, 6)  # ShearX .. Rotate: one batched affine for all of them


@functools.cache
def policy_transform(name: str) -> v2.Transform:
    """torchvision's policy of ``--auto_augment name``: its augmentation space and settings."""
    policy = AUTO_AUGMENT[name]()
    if tuple(policy._AUGMENTATION_SPACE) != OPS or getattr(policy, "num_ops", 1) > SLOTS:
        raise ValueError(f"{type(policy).__name__}: not the ops this module batches")
    return policy


def draw_policy(name: str) -> list[int]:
    """One sample's choices as ``POLICY_WIDTH`` ints, from torch's CPU generator with the calls of
    torchvision's ``forward`` in its order: per op, ``randint(len(ops), ())``, TrivialAugment's
    magnitude bin ``randint(num_bins, ())``, then ``rand(()) <= 0.5`` negates a signed op."""
    policy = policy_transform(name)
    fixed_bin = policy.magnitude if isinstance(policy, v2.RandAugment) else None
    row = list(NO_POLICY)
    for slot in range(getattr(policy, "num_ops", 1)):
        op = int(torch.randint(len(OPS), ()))
        magnitudes_fn, signed = policy._AUGMENTATION_SPACE[OPS[op]]
        bin_, negative = 0, 0
        if magnitudes_fn(2, 1, 1) is not None:  # else no magnitude: nothing more drawn
            if fixed_bin is None:
                bin_ = int(torch.randint(policy.num_magnitude_bins, ()))
            else:
                bin_ = fixed_bin
            negative = int(bool(signed and torch.rand(()) <= 0.5))
        row[slot_columns(slot)] = [op, bin_, negative]
    return row

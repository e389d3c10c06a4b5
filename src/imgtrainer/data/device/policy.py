"""TrivialAugment and RandAugment on whole batches on the device, grouped by op.

``BatchPolicy`` applies each op to all the samples that drew it (``host.draws.draw_policy``)
at once, with torchvision's arithmetic (uint8, nearest interpolation, fill 0): a sample comes
out as torchvision's policy, drawing the same ops, would make it. Two torchvision privates,
``_get_inverse_affine_matrix`` and ``_AUGMENTATION_SPACE``, give the numbers
(tests/test_batch_policy.py checks them against the installed torchvision).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF
from torchvision.transforms.v2.functional._geometry import _get_inverse_affine_matrix

from imgtrainer import torch_compat
from imgtrainer.data.host.draws import GEOMETRIC, OPS, policy_transform
from imgtrainer.data.host.sample_row import OP, slot_of

# What one slot's ops need per sample, worked out on the host from the row's choices (not
# drawn: no home in the row), as float32 columns moved to the device together.
FACTOR, ALPHA, THRESHOLD, MASK = range(4)  # 1 + m and 1 - (1 + m); 255 m; posterize's bits
THETA = 4  # and six more: the affine ops' inverse matrix
VALUES = THETA + 6


def magnitude_table(name: str, size: int) -> torch.Tensor:
    """(len(OPS), num_bins) float64: torchvision's magnitude of each op and bin (float32
    values, as ``float(magnitudes[bin])`` reads them) for size x size images; 0 where none."""
    policy = policy_transform(name)
    bins = policy.num_magnitude_bins
    table = torch.zeros(len(OPS), bins, dtype=torch.float64)
    for op, name_ in enumerate(OPS):
        magnitudes = policy._AUGMENTATION_SPACE[name_][0](bins, size, size)
        if magnitudes is not None:
            table[op] = magnitudes.double()
    return table


def affine_matrix(op: str, magnitude: float, size: int) -> list[float]:
    """The inverse affine matrix torchvision's ``affine``/``rotate`` builds for this op on a
    size x size image (pixel units, origin at the image's centre)."""
    if op in ("ShearX", "ShearY"):
        shear = math.degrees(math.atan(magnitude))
        corner = 0.0 - size * 0.5  # the policy's center=[0, 0]: the top left corner
        shears = [shear, 0.0] if op == "ShearX" else [0.0, shear]
        return _get_inverse_affine_matrix([corner, corner], 0.0, [0.0, 0.0], 1.0, shears)
    if op in ("TranslateX", "TranslateY"):
        shift = [float(int(magnitude)), 0.0] if op == "TranslateX" else [0.0, float(int(magnitude))]
        return _get_inverse_affine_matrix([0.0, 0.0], 0.0, shift, 1.0, [0.0, 0.0])
    # rotate's own angle convention: the angle mod 360, negated
    return _get_inverse_affine_matrix([0.0, 0.0], -(magnitude % 360), [0.0, 0.0], 1.0, [0.0, 0.0])


def slot_values(ops: list[int], magnitudes: list[float], size: int) -> torch.Tensor:
    """(N, VALUES) float32 host tensor: what each sample's op needs, rounded to float32 from
    the float64 values torchvision computes from the magnitude (0 where unused)."""
    rows = []
    for op, m in zip(ops, magnitudes, strict=True):
        row = [1.0 + m, 1.0 - (1.0 + m), 255.0 * m, 255.0] + [0.0] * 6
        if OPS[op] == "Posterize" and int(m) < 8:
            row[MASK] = ((1 << int(m)) - 1) << (8 - int(m))  # keep the top int(m) bits
        elif op in GEOMETRIC:
            row[THETA:] = affine_matrix(OPS[op], m, size)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).view(-1, VALUES).float()


def per_image(values: torch.Tensor) -> torch.Tensor:
    """One value per sample (n,), shaped (n, 1, 1, 1) to broadcast over its images."""
    return values.view(-1, 1, 1, 1)


def blend(
    images: torch.Tensor, other: torch.Tensor, factor: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """torchvision's ``_blend`` with per-sample ratios (n,) float32: ``images * factor + other *
    alpha``, alpha = 1 - factor, where its ``add_(alpha=)`` rounds once (a fused multiply-add):
    done exactly in float64."""
    scaled = images.float().mul_(per_image(factor)).double()
    other = other.double().mul_(per_image(alpha).double())
    return scaled.add_(other).float().clamp_(0, 255).to(torch.uint8)


@functools.cache
def sharpen_kernel(device: torch.device) -> torch.Tensor:
    """torchvision's sharpness blur: 3x3 13ths, 5 in the middle, per channel (3, 1, 3, 3);
    made once per device."""
    kernel = torch.full((3, 3), 1.0 / 13.0, device=device)
    kernel[1, 1] = 5.0 / 13.0
    return kernel.expand(3, 1, 3, 3)


def sharpen(
    images: torch.Tensor, alpha: torch.Tensor, kernel: torch.Tensor | None = None
) -> torch.Tensor:
    """torchvision's ``adjust_sharpness`` with per-sample factors: the inside pixels moved
    towards the rounded 3x3 blur (``sharpen_kernel``, made here when not given) by ``alpha``
    (n,) = 1 - factor; the border kept."""
    if images.shape[-1] <= 2:
        return images
    kernel = sharpen_kernel(images.device) if kernel is None else kernel
    out = images.float()
    blurred = F.conv2d(out, kernel, groups=3).round_()
    inside = out[..., 1:-1, 1:-1]
    alpha = per_image(alpha).double()  # fused as in blend
    moved = blurred.sub_(inside).double().mul_(alpha).add_(inside.double())
    inside.copy_(moved.float())
    return out.clamp_(0, 255).to(torch.uint8)


def autocontrast(images: torch.Tensor) -> torch.Tensor:
    """torchvision's ``autocontrast_image`` (per image and channel, its arithmetic), with
    ``masked_fill`` for its masked writes, which wait for the device on CUDA."""
    x = images.float()
    low = x.amin(dim=(-2, -1), keepdim=True)
    high = x.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    inv_scale = (high - low).mul_(1.0 / 255).masked_fill_(flat, 1.0)
    return x.sub_(low.masked_fill_(flat, 0.0)).div_(inv_scale).clamp_(0, 255).to(torch.uint8)


class BatchPolicy:
    """(uint8 images (N, 3, size, size) on any device, the host's int64 choices (N,
    POLICY_WIDTH)) -> the images with each sample's drawn ops applied, slot by slot."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self.transform = policy_transform(name)
        self.num_ops = getattr(self.transform, "num_ops", 1)
        self.table = magnitude_table(name, size)

    def magnitudes(self, choices: torch.Tensor, slot: int) -> torch.Tensor:
        """(N,) float64: each sample's signed magnitude in ``slot``, as torchvision's float."""
        ops, bins, negative = slot_of(choices, slot).T
        return self.table[ops, bins] * (1 - 2 * negative)

    def __call__(self, images: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
        for slot in range(self.num_ops):
            ops = slot_of(choices, slot)[:, OP]
            values = slot_values(ops.tolist(), self.magnitudes(choices, slot).tolist(), self.size)
            order = torch.argsort(ops, stable=True)
            counts = torch.bincount(ops, minlength=len(OPS)).tolist()
            # One copy of the grouping and the values to the device per slot; groups are slices.
            device_order = order.to(images.device, non_blocking=True)
            device_values = values[order].to(images.device, non_blocking=True)
            starts = [sum(counts[:op]) for op in range(len(OPS) + 1)]
            groups = [(OPS[op], starts[op], starts[op + 1]) for op in range(6, len(OPS))]
            groups.append(("affine", starts[GEOMETRIC.start], starts[GEOMETRIC.stop]))
            for op, start, stop in groups:
                if start == stop:
                    continue
                rows = device_order[start:stop]
                group = images.index_select(0, rows)
                images.index_copy_(0, rows, self.apply(op, group, device_values[start:stop]))
        return images

    def apply(self, op: str, images: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One op on a group of uint8 images, with their per-sample ``values`` rows."""
        if op == "affine":
            return self.affine(images, values[:, THETA:])
        factor, alpha = values[:, FACTOR], values[:, ALPHA]
        if op == "Brightness":
            scaled = images.float().mul_(per_image(factor))
            return scaled.clamp_(0, 255).to(torch.uint8)
        if op == "Color":  # towards the floored grey
            return blend(images, TF.rgb_to_grayscale(images).float(), factor, alpha)
        if op == "Contrast":
            grey = TF.rgb_to_grayscale(images).float()
            return blend(images, grey.mean(dim=(-3, -2, -1), keepdim=True), factor, alpha)
        if op == "Sharpness":
            # A new group size each batch: cuDNN would autotune the convolution for every one.
            # The flag is global: only the training thread's CUDA batches touch it (the data
            # audit runs this policy on the CPU in its own thread).
            off = (
                torch_compat.cudnn_autotuning_off() if images.is_cuda else contextlib.nullcontext()
            )
            with off:
                return sharpen(images, alpha, sharpen_kernel(images.device))
        if op == "Posterize":
            return images.bitwise_and_(per_image(values[:, MASK]).to(torch.uint8))
        if op == "Solarize":  # compared in float32, as uint8 >= a Python float is
            flip = images.float() >= per_image(values[:, THRESHOLD])
            return torch.where(flip, images.bitwise_not(), images)
        if op == "AutoContrast":
            return autocontrast(images)
        if op == "Equalize":
            return TF.equalize(images)
        raise ValueError(f"no batched op {op}")

    def affine(self, images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """One nearest ``grid_sample`` for the group, each sample with its own inverse matrix,
        the grid made as torchvision's ``_affine_grid`` makes it (zeros outside: fill 0)."""
        n, size = len(images), self.size
        base, half = affine_grid(size, images.device)
        rescaled = (theta.view(n, 2, 3).transpose(1, 2) / half).contiguous()
        grid = base.expand(n, -1, -1).bmm(rescaled)
        grid = grid.view(n, size, size, 2)
        out = F.grid_sample(
            images.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False
        )
        return out.round_().to(torch.uint8)


@functools.cache
def affine_grid(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Made once per size and device: the base grid (1, size * size, 3) float32, the output
    pixels' centres with the origin at the centre, and the half size (2,) that scales the
    matrices to [-1, 1]."""
    grid = torch.empty(1, size, size, 3, device=device)
    steps = torch.linspace((1.0 - size) * 0.5, (size - 1.0) * 0.5, size, device=device)
    grid[..., 0].copy_(steps)
    grid[..., 1].copy_(steps.unsqueeze(-1))
    grid[..., 2].fill_(1)
    half = torch.full((2,), 0.5 * size, device=device)
    return grid.view(1, size * size, 3), half

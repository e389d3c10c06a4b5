"""Images of different sizes in one flat buffer, and their boxes gathered onto a padded canvas in
a fixed number of kernels, whatever the batch size.

The loader workers send a batch's crops as ``Ragged`` (only their bytes: no padding crosses to
the device), and the device decoder keeps each chunk of decoded JPEGs in one buffer too; both
are put on the canvas the augmentation reads by ``gather_boxes``: one ``index_select`` of whole
rows from a sliding-window view of the buffer (``unfold``), then one mask. That is about twenty
ops per batch, against a few per image for slicing and copying each piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

# Columns of a box table: where an image starts in the buffer, its height and width, then the
# box cut from it (top, left, height, width).
OFFSET, FULL_H, FULL_W, BOX_TOP, BOX_LEFT, BOX_H, BOX_W = range(7)
BOX = slice(BOX_TOP, BOX_W + 1)


@dataclass(frozen=True)
class Ragged:
    """``N`` uint8 CHW images, each's bytes after the previous one's in ``data`` (1-D), with
    enough zeros after the last for ``gather_boxes``' window; ``sizes`` (N, 2) int64 on the
    host: each image's (height, width)."""

    data: torch.Tensor
    sizes: torch.Tensor

    @staticmethod
    def of(images: Sequence[torch.Tensor]) -> Ragged:
        """The images (3, h, w) packed, on their device (the sizes on the host)."""
        sizes = torch.tensor([image.shape[-2:] for image in images], dtype=torch.int64)
        tail = images[0].new_zeros(int(sizes[:, 1].max()))
        return Ragged(torch.cat([image.reshape(-1) for image in images] + [tail]), sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def pin_memory(self) -> Ragged:  # the DataLoader's pin_memory calls this
        return replace(self, data=self.data.pin_memory())

    def to(self, device: torch.device, non_blocking: bool = False) -> Ragged:
        """The buffer on ``device``; the sizes stay on the host, where the canvas is planned."""
        return replace(self, data=self.data.to(device, non_blocking=non_blocking))

    def canvas(self) -> torch.Tensor:
        """(N, 3, H, W) with each image at the top left, zeros elsewhere; H, W the largest."""
        return gather_boxes(self.data, whole_boxes(self.sizes))


def whole_boxes(sizes: torch.Tensor) -> torch.Tensor:
    """The box table (N, 7) of images packed one after another, each box the whole image."""
    heights, widths = sizes.unbind(1)
    offsets = torch.cumsum(3 * heights * widths, 0) - 3 * heights * widths
    zero = torch.zeros_like(heights)
    # OFFSET, FULL_H, FULL_W, then the box: all of the image
    return torch.stack([offsets, heights, widths, zero, zero, heights, widths], 1)


def gather_boxes(data: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) uint8 on ``data``'s device: row n holds box n (``boxes``: the (N, 7) host
    table of ``OFFSET``...``BOX_W``) of the CHW image at its offset in ``data``, at the top left,
    zeros elsewhere; H, W the largest box's. ``data`` must run on at least W bytes past the
    last image (``Ragged.of`` adds them). The table is on the host: the canvas's size is known
    without a device sync."""
    height, width = int(boxes[:, BOX_H].max()), int(boxes[:, BOX_W].max())
    table = boxes.to(data.device, non_blocking=True)[:, :, None, None]
    offset, full_h, full_w = table[:, OFFSET], table[:, FULL_H], table[:, FULL_W]
    top, left, box_h, box_w = (
        table[:, BOX_TOP],
        table[:, BOX_LEFT],
        table[:, BOX_H],
        table[:, BOX_W],
    )
    y = torch.arange(height, device=data.device)
    channel = torch.arange(3, device=data.device)[None, :, None]
    # Where each canvas row starts in data: (N, 3, H); rows below a box start at 0 (masked).
    starts = offset + channel * full_h * full_w + (top + y) * full_w + left
    inside_rows = y < box_h  # (N, 1, H)
    starts = torch.where(inside_rows, starts, 0)
    # Row k of the window view is data[k : k + width]: one gather copies every canvas row.
    windows = data.unfold(0, width, 1)
    canvas = windows.index_select(0, starts.reshape(-1)).view(len(boxes), 3, height, width)
    inside_cols = torch.arange(width, device=data.device) < box_w[..., None]  # (N, 1, 1, W)
    return canvas.mul_(inside_rows[..., None]).mul_(inside_cols)  # no (N, 1, H, W) mask


def as_canvas(pixels: torch.Tensor | Ragged) -> torch.Tensor:
    """A batch's pixels as the (N, 3, H, W) canvas the augmentation reads."""
    return pixels.canvas() if isinstance(pixels, Ragged) else pixels

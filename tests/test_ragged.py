"""Packed images of different sizes: what crosses to the device is their bytes alone, and the
canvas gathered from them is the padded one, box by box; the decoder's grouped shrink is the
per-image one."""

from __future__ import annotations

import torch

from imgtrainer.data.device.jpeg import shrink, shrink_group
from imgtrainer.data.host.ragged import BOX, Ragged, gather_boxes, whole_boxes


def images(count: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 40, (count, 2), generator=g).tolist()
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def padded(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The reference: each piece at the top left of a zero canvas as large as the largest."""
    height = max(p.shape[-2] for p in pieces)
    width = max(p.shape[-1] for p in pieces)
    canvas = torch.zeros(len(pieces), 3, height, width, dtype=torch.uint8)
    for n, p in enumerate(pieces):
        canvas[n, :, : p.shape[-2], : p.shape[-1]] = p
    return canvas


def test_packed_images_hold_only_their_bytes_and_lay_out_as_the_padded_canvas():
    pieces = images(9)
    packed = Ragged.of(pieces)
    pixels = sum(p.numel() for p in pieces)
    # The bytes, plus one row's worth of zeros for the gather's window.
    assert packed.data.numel() == pixels + max(p.shape[-1] for p in pieces)
    assert packed.sizes.tolist() == [list(p.shape[-2:]) for p in pieces]
    assert torch.equal(packed.canvas(), padded(pieces))
    assert torch.equal(Ragged.of(pieces[:1]).canvas(), pieces[0][None])


def test_boxes_are_gathered_from_each_image_onto_one_canvas():
    pieces = images(12, seed=1)
    g = torch.Generator().manual_seed(2)
    boxes, crops = [], []
    for p in pieces:
        height, width = p.shape[-2:]
        top = int(torch.randint(0, height, (1,), generator=g))
        left = int(torch.randint(0, width, (1,), generator=g))
        h = int(torch.randint(1, height - top + 1, (1,), generator=g))
        w = int(torch.randint(1, width - left + 1, (1,), generator=g))
        boxes.append([top, left, h, w])
        crops.append(p[:, top : top + h, left : left + w])
    ragged = Ragged.of(pieces)
    table = whole_boxes(ragged.sizes)
    table[:, BOX] = torch.tensor(boxes)
    got = gather_boxes(ragged.data, table)
    assert torch.equal(got, padded(crops))


def test_the_grouped_shrink_is_each_crops_own():
    g = torch.Generator().manual_seed(3)
    for factor in (2, 3, 5):
        sizes = torch.randint(factor, 9 * factor, (6, 2), generator=g)
        crops = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
        got = shrink_group(padded(crops), sizes, factor)
        assert torch.equal(got, padded([shrink(c, factor) for c in crops]))
    assert torch.equal(shrink_group(padded(crops), sizes, 1), padded(crops))

"""The sample row: what the host drew for one sample and the device applies to it.

One int64 row per sample (``draws`` writes it, ``device.augment`` reads it), stacked
(N, ROW_WIDTH) by the collate. This is the one home of its layout: read and write it through
these names and helpers only. Its columns: the crop box, the flip, the erasing box, the
``--auto_augment`` policy's slots, then the box as drawn in the image and the sample's key
(index, epoch): with them the data audit makes the sample again, without drawing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The crop box (in the pixels the sample hands over), the horizontal flip (0 or 1), the
# random-erasing rectangle in the output (h = w = 0: none), then the policy's choices.
TOP, LEFT, HEIGHT, WIDTH, FLIP, ERASE_TOP, ERASE_LEFT, ERASE_H, ERASE_W, POLICY = range(10)
CROP = slice(TOP, WIDTH + 1)
ERASE = slice(ERASE_TOP, ERASE_W + 1)

# The policy's columns: per op slot, the op's index (0: Identity), its magnitude bin, 1 where
# negated (draws.draw_policy draws them; device.policy.BatchPolicy applies them).
SLOTS = 2  # ops per sample at most: TrivialAugment applies 1, RandAugment (num_ops=2) 2
OP, BIN, NEGATIVE = range(3)  # a slot's columns
SLOT_WIDTH = 3
POLICY_WIDTH = SLOT_WIDTH * SLOTS
# The crop box as drawn, in the whole image (the crop box above becomes the box in the pixels a
# sample hands over), and the sample's key, (index, epoch) of the dataset (-1 until ``set_key``).
DRAWN = slice(POLICY + POLICY_WIDTH, POLICY + POLICY_WIDTH + 4)
INDEX = DRAWN.stop
EPOCH = INDEX + 1
ROW_WIDTH = EPOCH + 1

NO_ERASE = (0, 0, 0, 0)
NO_POLICY = (0,) * POLICY_WIDTH
NO_KEY = (-1, -1)


def row_of(
    crop: Sequence[int],
    flip: int,
    erase: Sequence[int] = NO_ERASE,
    policy: Sequence[int] = NO_POLICY,
) -> torch.Tensor:
    """One sample's row (ROW_WIDTH,) int64 from its parts (``crop`` as drawn), its key not
    set."""
    row = torch.tensor([*crop, flip, *erase, *policy, *crop, *NO_KEY], dtype=torch.int64)
    if len(row) != ROW_WIDTH:
        raise ValueError(f"a sample row has {ROW_WIDTH} columns, not {len(row)}")
    return row


def set_key(row: torch.Tensor, key: tuple[int, int]) -> None:
    """The sample's (index, epoch) into its row."""
    row[INDEX], row[EPOCH] = key


def key_of(row: torch.Tensor) -> tuple[int, int]:
    """The sample's (index, epoch) from its row (on the host)."""
    index, epoch = row[INDEX : EPOCH + 1].tolist()
    return index, epoch


def crop_of(rows: torch.Tensor) -> torch.Tensor:
    """The crop boxes (..., 4): top, left, height, width; a view of the row(s)."""
    return rows[..., CROP]


def crop_size_of(rows: torch.Tensor) -> torch.Tensor:
    """The crop boxes' (height, width) (..., 2); a view of the row(s)."""
    return rows[..., HEIGHT : WIDTH + 1]


def drawn_of(rows: torch.Tensor) -> torch.Tensor:
    """The crop boxes as drawn in the whole images (..., 4); a view of the row(s)."""
    return rows[..., DRAWN]


def set_whole_crop(row: torch.Tensor, height: int, width: int) -> None:
    """The box of a sample whose pixels are now its crop: all of them, from the top left."""
    row[CROP] = torch.tensor([0, 0, height, width])


def erase_of(rows: torch.Tensor) -> torch.Tensor:
    """The erasing rectangles (..., 4): top, left, height, width; a view of the row(s)."""
    return rows[..., ERASE]


def policy_of(rows: torch.Tensor) -> torch.Tensor:
    """The policy's choices (..., POLICY_WIDTH); a view of the row(s)."""
    return rows[..., POLICY : POLICY + POLICY_WIDTH]


def slot_columns(slot: int) -> slice:
    """Where one slot's (op, bin, negative) are among the policy's choices."""
    return slice(SLOT_WIDTH * slot, SLOT_WIDTH * (slot + 1))


def slot_of(choices: torch.Tensor, slot: int) -> torch.Tensor:
    """One slot's (op, bin, negative) columns of the policy's choices (..., SLOT_WIDTH); a view."""
    return choices[..., slot_columns(slot)]

"""The per-sample parameter row, the one home of its layout: what the host drew for a sample
(``AugmentDraws``) and the device applies to it (``BatchAugment``), one int64 row per sample,
stacked (N, PARAMS) by the collate. Read and write it through these names and helpers only.

Integer columns first: crop box, flip, erasing box, the ``--auto_augment`` policy's slots.
Continuous per-sample factors follow from ``FACTORS`` on, each a float64 kept bit for bit in
an int64 slot (``row_of`` writes them, ``factor_of`` reads one as float64): the row stays one
tensor through collate, pinning, the JPEG decoder's fallback and the copy to the device.
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
# negated (batch_policy.draw_policy draws them; BatchPolicy applies them).
SLOTS = 2  # ops per sample at most: TrivialAugment applies 1, RandAugment (num_ops=2) 2
OP, BIN, NEGATIVE = range(3)  # a slot's columns
COLUMNS = 3 * SLOTS
POLICY_COLUMNS = slice(POLICY, POLICY + COLUMNS)

# Continuous factors (float64 in int64 slots), in the order row_of takes them. None yet; a new
# one is one name here, NAME = FACTORS + k, with FACTOR_COUNT raised to match.
FACTORS = POLICY + COLUMNS
FACTOR_COUNT = 0
PARAMS = FACTORS + FACTOR_COUNT

NO_ERASE = (0, 0, 0, 0)
NO_POLICY = (0,) * COLUMNS


def row_of(
    crop: Sequence[int],
    flip: int,
    erase: Sequence[int] = NO_ERASE,
    policy: Sequence[int] = NO_POLICY,
    factors: Sequence[float] = (),
) -> torch.Tensor:
    """One sample's row (PARAMS,) int64 from its parts, ``factors`` as float64 bits."""
    ints = torch.tensor([*crop, flip, *erase, *policy], dtype=torch.int64)
    if len(ints) != FACTORS or len(factors) != FACTOR_COUNT:
        raise ValueError(f"a row has {FACTORS} int columns and {FACTOR_COUNT} factors")
    if not FACTOR_COUNT:
        return ints
    return torch.cat([ints, torch.tensor(factors, dtype=torch.float64).view(torch.int64)])


def crop_of(rows: torch.Tensor) -> torch.Tensor:
    """The crop boxes (..., 4): top, left, height, width; a view of the row(s)."""
    return rows[..., CROP]


def crop_size_of(rows: torch.Tensor) -> torch.Tensor:
    """The crop boxes' (height, width) (..., 2); a view of the row(s)."""
    return rows[..., HEIGHT : WIDTH + 1]


def set_whole_crop(row: torch.Tensor, height: int, width: int) -> None:
    """The box of a sample whose pixels are now its crop: all of them, from the top left."""
    row[CROP] = torch.tensor([0, 0, height, width])


def erase_of(rows: torch.Tensor) -> torch.Tensor:
    """The erasing rectangles (..., 4): top, left, height, width; a view of the row(s)."""
    return rows[..., ERASE]


def policy_of(rows: torch.Tensor) -> torch.Tensor:
    """The policy's choices (..., COLUMNS); a view of the row(s)."""
    return rows[..., POLICY_COLUMNS]


def slot_of(choices: torch.Tensor, slot: int) -> torch.Tensor:
    """One slot's (op, bin, negative) columns of the policy's choices (..., 3)."""
    return choices[..., 3 * slot : 3 * slot + 3]


def factor_of(rows: torch.Tensor, column: int) -> torch.Tensor:
    """One continuous factor of the row(s) (...,) as float64, on the rows' device."""
    if not FACTORS <= column < PARAMS:
        raise IndexError(f"column {column} is not a factor's ({FACTORS} to {PARAMS - 1})")
    return rows[..., column].view(torch.float64)

"""Evaluation's resize and crop, normalisation, and the augmentation policies' names.

The training crop, flip, policy and erasing run per batch (``device.augment``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# The default of --eval_resize_ratio (timm's crop_pct): resize to size/0.875, then center-crop
# to size (the usual 224/256).
EVAL_RESIZE_RATIO = 0.875


# ----------------------------------------------------------------------------- transforms


def eval_transforms(image_size: int, eval_resize_ratio: float = EVAL_RESIZE_RATIO) -> v2.Compose:
    """Evaluation: resize the short side to ``eval_resize_side``, then crop the centre. Also
    built from a checkpoint's values by evaluate.py and predict.py."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(eval_resize_side(image_size, eval_resize_ratio), antialias=True),
            v2.CenterCrop(image_size),
        ]
    )


def eval_resize_side(image_size: int, ratio: float = EVAL_RESIZE_RATIO) -> int:
    """The short side evaluation resizes to before its centre crop of ``image_size``."""
    return int(math.ceil(image_size / ratio))


AUTO_AUGMENT = {
    "trivialaugment": v2.TrivialAugmentWide,
    "randaugment": v2.RandAugment,  # torchvision's defaults: 2 ops at magnitude 9 of 31
}


def normalize_batch(
    images: torch.Tensor,
    mean: Sequence[float] | torch.Tensor = IMAGENET_MEAN,
    std: Sequence[float] | torch.Tensor = IMAGENET_STD,
) -> torch.Tensor:
    """uint8 (N, 3, H, W) in 0..255 -> float32 normalised with ``mean`` and ``std``, as
    torchvision's Normalize does (in place when ``images`` is float32 already)."""
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    return images.float().div_(255).sub_(mean_t).div_(std_t)

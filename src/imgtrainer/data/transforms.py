"""Image transforms: the seeded random crop and flip, the augmentation policies, normalisation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision.transforms import v2

from imgtrainer.run.config import TrainConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# The default of --eval_resize_ratio (timm's crop_pct): resize to size/0.875, then center-crop
# to size (the usual 224/256).
EVAL_RESIZE_RATIO = 0.875


# ----------------------------------------------------------------------------- transforms


class RandomResizedCropFlip:
    """torchvision's RandomResizedCrop then RandomHorizontalFlip, on uint8 images, drawing all its
    random numbers from the torch generator in one call.

    The same distribution and the same bilinear, antialiased resize as the v2 transforms, for a
    fraction of their Python dispatch cost (bench/throughput.py).
    """

    TRIES = 10  # like torchvision: then fall back to a center crop

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
    ):
        self.size, self.scale, self.hflip = size, scale, hflip
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.ratio = ratio

    def __call__(self, image: Image.Image | torch.Tensor) -> torch.Tensor:
        if isinstance(image, Image.Image):
            image = v2.functional.pil_to_tensor(image)
        height, width = image.shape[-2:]
        uniforms = torch.rand(2 * self.TRIES + 3).tolist()
        top, left, h, w = self.crop_box(height, width, uniforms)
        crop = image[None, :, top : top + h, left : left + w].float()
        out = torch.nn.functional.interpolate(
            crop, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False
        )[0]
        if uniforms[-1] < self.hflip:
            out = out.flip(-1)
        return out.round_().clamp_(0, 255).to(torch.uint8)

    def crop_box(self, height: int, width: int, u: list[float]) -> tuple[int, int, int, int]:
        """torchvision's RandomResizedCrop.get_params, fed with uniforms in [0, 1)."""
        area = height * width
        for t in range(self.TRIES):
            target = area * (self.scale[0] + u[2 * t] * (self.scale[1] - self.scale[0]))
            aspect = math.exp(
                self.log_ratio[0] + u[2 * t + 1] * (self.log_ratio[1] - self.log_ratio[0])
            )
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(u[-3] * (height - h + 1)), int(u[-2] * (width - w + 1)), h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = height, int(round(height * self.ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


def train_transforms(cfg: TrainConfig) -> v2.Compose | RandomResizedCropFlip:
    """Per-sample training augmentation on uint8 images, the one place that reads the
    augmentation flags: the crop and flip, then ``--auto_augment``'s policy, then random
    erasing, in the order of torchvision's reference recipe. Every random number comes from
    torch's CPU generator, which ``SeededImageDataset`` seeds per sample; the images may be CPU
    or CUDA tensors (``--cache_images gpu``). Conversion to float and normalization happen once
    per batch in ``collate_normalized``: cheaper than per sample, and 4x fewer bytes between
    processes."""
    crop = RandomResizedCropFlip(cfg.image_size, scale=(cfg.crop_scale_min, 1.0), hflip=cfg.hflip)
    extra = []
    if cfg.auto_augment != "none":
        extra.append(AUTO_AUGMENT[cfg.auto_augment]())
    if cfg.random_erasing > 0:
        # torchvision's recipe erases after normalization with 0, i.e. with the mean colour;
        # here the images are still uint8, so the rectangle gets the mean colour in 0..255.
        mean_colour = [round(255 * m) for m in IMAGENET_MEAN]
        extra.append(v2.RandomErasing(p=cfg.random_erasing, value=mean_colour))
    return v2.Compose([crop, *extra]) if extra else crop


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
    images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> torch.Tensor:
    """uint8 (N, 3, H, W) in 0..255 -> float32, normalized with ``mean`` and ``std``."""
    mean_t = torch.tensor(mean, device=images.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=images.device).view(1, 3, 1, 1)
    return images.float().div_(255).sub_(mean_t).div_(std_t)


def collate_normalized(
    batch: list[tuple[torch.Tensor, int]],
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = default_collate(batch)
    return normalize_batch(images, mean, std), labels

"""The bundled demo: scikit-learn's digits (1,797 real 8x8 scans, 10 classes) as a PNG ImageFolder.

Written once to data/demo/{train,val}/<digit>/*.png with a stratified 80/20 split and a fixed
seed, then reused. A marker file written last means an interrupted write is redone, not reused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from imgtrainer.config import (
    TrainConfig,
)
from imgtrainer.distributed.collectives import (
    barrier,
)
from imgtrainer.distributed.setup import (
    DistInfo,
)

DEMO_IMAGE_SIZE = 32  # the 8x8 scans are upscaled so the crop transforms have room to work


_MARKER = ".complete"


def write_demo_dataset(root: Path, seed: int = 0, val_ratio: float = 0.2) -> tuple[Path, Path]:
    """Make sure ``root/train`` and ``root/val`` hold the demo images; return both folders."""
    train_dir, val_dir = root / "train", root / "val"
    if (root / _MARKER).is_file():
        return train_dir, val_dir
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    indices = np.arange(len(digits.target))
    train_idx, val_idx = train_test_split(
        indices, test_size=val_ratio, random_state=seed, stratify=digits.target
    )
    for folder in (train_dir, val_dir):
        shutil.rmtree(folder, ignore_errors=True)
    for folder, split in ((train_dir, train_idx), (val_dir, val_idx)):
        for i in split:
            label = int(digits.target[i])
            pixels = (digits.images[i] * (255.0 / 16.0)).astype(np.uint8)  # values are 0..16
            image = Image.fromarray(pixels, mode="L").resize(
                (DEMO_IMAGE_SIZE, DEMO_IMAGE_SIZE), Image.BILINEAR
            )
            out = folder / str(label) / f"digit_{i:04d}.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            image.save(out)
    (root / _MARKER).write_text(f"{len(train_idx)} train, {len(val_idx)} val\n")
    return train_dir, val_dir


DEMO_ROOT = Path("data/demo")


def prepare_demo_data(cfg: TrainConfig, dist: DistInfo) -> None:
    """The first process on each node writes the demo data; the others wait for it."""
    if cfg.demo and dist.local_rank == 0:
        write_demo_dataset(DEMO_ROOT)
    barrier()

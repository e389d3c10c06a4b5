"""Shared helpers: tiny generated image folders and running the real command-line tools."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(ROOT))  # launch_ddp

# Distinct colours per class: a trivially separable problem a tiny run can learn.
COLOURS = [(220, 30, 30), (30, 200, 40), (40, 60, 220), (230, 220, 40), (200, 40, 200)]


def write_image_folder(root: Path, classes: list[str], per_class: int, size: int = 16,
                       seed: int = 0, ext: str = "jpg") -> Path:
    """``root/<class>/img_<i>.<ext>``: each class a noisy patch of its own colour."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            base = np.array(COLOURS[c % len(COLOURS)], dtype=np.float32)
            pixels = np.clip(base + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"img_{i:03d}.{ext}")
    return root


@pytest.fixture
def tiny_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """3 classes, 16 train and 5 val images each (15 val: not a multiple of 2)."""
    classes = ["cat", "dog", "fox"]
    train = write_image_folder(tmp_path / "data" / "train", classes, 16, seed=1)
    val = write_image_folder(tmp_path / "data" / "val", classes, 5, seed=2)
    return train, val


# Flags that make a training run on the tiny dataset take seconds.
TINY_FLAGS = ["--image_size", "16", "--batch_size", "8", "--num_workers", "0",
              "--learning_rate", "0.01", "--log_interval", "1"]


def run_cli(args: list[str], cwd: Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run ``python <args>`` the way a user would, capturing its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env, **kwargs)


def assert_user_error(result: subprocess.CompletedProcess, *phrases: str) -> None:
    """Exit code 2, one error line naming the problem, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in error_lines[0], error_lines[0]

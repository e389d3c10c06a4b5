"""What the tests and the benchmarks share: generated ImageFolders, and the launcher (or any
command-line tool) run in a new interpreter, the way a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch_ddp.py"

# Distinct colours for the first classes: a trivially separable problem a tiny run can learn.
COLOURS = [(220, 30, 30), (30, 200, 40), (40, 60, 220), (230, 220, 40), (200, 40, 200)]


def class_colour(index: int) -> tuple[int, int, int]:
    if index < len(COLOURS):
        return COLOURS[index]
    return ((index * 97 + 40) % 256, (index * 57 + 90) % 256, (index * 23 + 160) % 256)


def class_names(count: int) -> list[str]:
    """``class_00``, ``class_01``, ...: zero-padded so that they sort in index order."""
    width = max(2, len(str(count - 1)))
    return [f"class_{k:0{width}d}" for k in range(count)]


def write_image_folder(
    root: Path,
    classes: Sequence[str] | int,
    per_class: int,
    size: int = 16,
    seed: int = 0,
    ext: str = "jpg",
    *,
    noise: float = 25.0,
    coloured: bool = True,
    quality: int | None = None,
    threads: int = 1,
) -> Path:
    """``root/<class>/img_<i>.<ext>``: ``per_class`` images of ``size`` px for each of ``classes``
    (names, or a count: ``class_names``). Each image is Gaussian noise of std ``noise`` around
    its class's colour, or, not ``coloured``, uniform random pixels that tell no class apart.
    The same arguments write the same pixels; ``threads`` encode the files in parallel;
    ``quality``: JPEG quality (PIL's default without it)."""
    rng = np.random.default_rng(seed)
    names = class_names(classes) if isinstance(classes, int) else list(classes)
    options = {} if quality is None else {"quality": quality}

    def save(job: tuple[Path, np.ndarray]) -> None:
        Image.fromarray(job[1]).save(job[0], **options)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for c, name in enumerate(names):
            folder = root / name
            folder.mkdir(parents=True, exist_ok=True)
            base = np.array(class_colour(c), dtype=np.float32)
            jobs = []
            for i in range(per_class):
                if coloured:
                    pixels = np.clip(base + rng.normal(0, noise, (size, size, 3)), 0, 255)
                    pixels = pixels.astype(np.uint8)
                else:
                    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                jobs.append((folder / f"img_{i:03d}.{ext}", pixels))
            list(pool.map(save, jobs))
    return root


# ----------------------------------------------------------------------------- new interpreters


def run_cli(
    args: Sequence, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """``python <args>`` run the way a user would, its output captured as text; ``env``:
    variables set on top of this process's environment."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        **kwargs,
    )


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``env`` on top, output unbuffered (read as it comes)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def launcher_command(*args: object) -> list[str]:
    """``python launch_ddp.py <args>``, as a user types it."""
    return [sys.executable, str(LAUNCHER), *map(str, args)]


def run_launcher(
    args: Sequence, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python launch_ddp.py <args>`` to its end (``run_cli``)."""
    return run_cli([LAUNCHER, *args], cwd, timeout, env)


def start_launcher(
    args: Sequence, cwd: Path, env: dict[str, str] | None = None, **kwargs
) -> subprocess.Popen:
    """``python launch_ddp.py <args>`` started in the background, its output captured as text
    (``kwargs`` override ``subprocess.Popen``'s arguments)."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
    return subprocess.Popen(launcher_command(*args), cwd=cwd, env=child_env(env), **options)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun, the ranks, their loader workers), from /proc;
    torchrun runs in its own session, so its process group does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

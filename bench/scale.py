#!/usr/bin/env python
"""Start-up at scale: folders of 10k, 100k, 1M tiny JPEGs, the trainer beside timm's train.py.

    python bench/scale.py --timm_train /path/to/pytorch-image-models/train.py
    python bench/scale.py --sizes 10000 100000 --timm_train train.py
    python bench/scale.py --sizes 1000000 --runs auto-cold auto-warm   # the trainer only

For each size it builds ``train/<class>/`` with 100 images a class and ``val/`` with one a
class, in a temporary folder (never committed): ``--distinct`` different 40x32 JPEGs (default
512) hard-linked across the tree. Every path is its own directory entry, stat and decode, as
in a real folder, but the page cache holds the few distinct files: reads cost no disk time.
Then, one after the other on the same machine (ratios side by side in one run), each of:

  * timm:       timm's train.py (``--timm_train``) on the folder, 4 loader workers;
  * auto-cold:  the launcher, 1 CPU process, ``--cache_images auto``, a fresh log folder (the
                decode check from scratch);
  * auto-warm:  the same again in the same folders (the check remembered);
  * none-warm:  ``--cache_images none``, the check remembered;

each at 32 px, batch 64, 4 loader workers, stopped (SIGTERM) after ``--log_lines`` logged
training steps. Printed per run: seconds from the command's start to the end of the first
training step (the trainer's timeline; timm's first "Train:" line), images/s (the median of the
logged steps' own figures), and the resident memory of the training process and of its loader
workers, each sampled every 0.5 s and the peak kept: RSS, PSS (shared pages divided among
the processes that map them) and USS (pages of that process alone; a worker that touches the
Python lists it inherited copies them: pytorch/pytorch#13246), from /proc/<pid>/smaps_rollup.
Then, per size, the memory the index of both folders takes in a process (RSS before and after
listing them, in a fresh interpreter). Other work on the machine slows every figure: compare
the ratios.

timm's train.py of the repository's HEAD takes ``--device cpu``; its workers count ``-j 4``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from harness import child_env, descendants, launcher_command  # noqa: E402
from instrument.sitecustomize import timeline_env  # noqa: E402

PER_CLASS = 100
LOG_INTERVAL = 5  # steps between the logged figures images/s is read from
RUNS = ["timm", "auto-cold", "auto-warm", "none-warm"]
TRAINER_STEP = re.compile(r"step \d+/\d+ .* (\d+) img/s")
TIMM_STEP = re.compile(r"Train: \d+ \[\s*(\d+)/.*?,\s*([\d.]+)/s\s+\(")

INDEX_PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch, torchvision  # what a rank has imported before it lists the folders
from pathlib import Path
from imgtrainer.data.sources import ReadableImageFolder

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

before = rss()
folders = [ReadableImageFolder(Path(p)) for p in sys.argv[2:]]
print(rss() - before, sum(len(f.samples) for f in folders))
"""


def build_tree(root: Path, images: int, distinct: int) -> Path:
    """``root/train`` (``images`` files, PER_CLASS a class) and ``root/val`` (one a class)."""
    rng = np.random.default_rng(0)
    sources = root / "distinct"
    sources.mkdir(parents=True)
    for k in range(distinct):
        pixels = rng.integers(0, 256, (8, 10, 3), dtype=np.uint8)
        Image.fromarray(pixels).resize((40, 32)).save(sources / f"{k}.jpg", quality=85)
    files = [str(sources / f"{k}.jpg") for k in range(distinct)]
    classes = max(1, images // PER_CLASS)
    width = len(str(classes - 1))
    n = 0
    for c in range(classes):
        name = f"class_{c:0{width}d}"
        train, val = root / "train" / name, root / "val" / name
        train.mkdir(parents=True)
        val.mkdir(parents=True)
        for i in range(PER_CLASS):
            os.link(files[n % distinct], train / f"img_{i:03d}.jpg")
            n += 1
        os.link(files[(n + c) % distinct], val / "img_000.jpg")
    return root


def memory(pid: int) -> tuple[int, int, int] | None:
    """(RSS, PSS, USS) bytes of ``pid`` from smaps_rollup; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            kb[parts[0].rstrip(":")] = int(parts[1]) * 1024
    uss = kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)
    return kb.get("Rss", 0), kb.get("Pss", 0), uss


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Run:
    """One command to its first step and a few logged steps, its output and memory watched."""

    name: str
    command: list[str]
    cwd: Path
    env: dict[str, str]
    log_lines: int
    started: float = 0.0
    first_step: float | None = None
    rates: list[float] = field(default_factory=list)
    peaks: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)
    output: list[str] = field(default_factory=list)
    skipped: bool = False

    def watch_memory(self, process: subprocess.Popen, done: threading.Event) -> None:
        while not done.wait(0.5):
            pids = [process.pid, *descendants(process.pid)]
            parents = {pid: parent_of(pid) for pid in pids}
            leaves = [p for p in pids if p not in parents.values()]
            counts: dict[int, int] = {}
            for leaf in leaves:
                counts[parents[leaf]] = counts.get(parents[leaf], 0) + 1
            trainer = max(counts, key=counts.get) if len(leaves) > 1 else pids[-1]
            roles = {}
            for pid in pids:
                seen = memory(pid)
                if seen is None:
                    continue
                if pid == trainer or parents[pid] == trainer:
                    roles[pid] = "trainer" if pid == trainer else "worker"
                old = self.peaks.get(pid, (0, 0, 0))
                self.peaks[pid] = tuple(max(a, b) for a, b in zip(old, seen, strict=True))
            if len(roles) >= len(self.roles):  # the trainer with the most workers: training
                self.roles = roles

    def read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            now = time.time() - self.started
            self.output.append(line)
            timm = TIMM_STEP.search(line)
            ours = TRAINER_STEP.search(line)
            if timm and self.first_step is None:
                self.first_step = now
            if timm and int(timm.group(1)) > 0:
                self.rates.append(float(timm.group(2)))
            elif ours and self.skipped:
                self.rates.append(float(ours.group(1)))
            elif ours:
                self.skipped = True  # its steps include the first one's warm-up: as timm's
            if len(self.rates) >= self.log_lines and process.poll() is None:
                process.send_signal(signal.SIGTERM)

    def go(self, timeout: float) -> Run:
        self.started = time.time()
        process = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=child_env(self.env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its stop signal reaches it alone, as a user's kill would
        )
        done = threading.Event()
        watcher = threading.Thread(target=self.watch_memory, args=(process, done), daemon=True)
        watcher.start()
        reader = threading.Thread(target=self.read, args=(process,), daemon=True)
        reader.start()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            print(
                f"  {self.name}: over {timeout:.0f} s; its last lines:\n"
                + "".join(self.output[-8:])
            )
        finally:
            if process.poll() is None:  # over time, or this benchmark stopped: stop the run
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(120)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)  # its own session: the run's alone
                    process.wait()
        done.set()
        reader.join(10)
        timeline = self.cwd / "timeline.txt"
        if self.first_step is None and timeline.exists():
            for line in timeline.read_text().splitlines():
                stamp, _, event = line.split(" ", 2)
                if event == "first step done":
                    self.first_step = float(stamp) - self.started
                    break
        return self

    def row(self) -> str:
        mib = 2**20

        def peak(role: str) -> str:
            rows = [v for pid, v in self.peaks.items() if self.roles.get(pid) == role]
            if not rows:
                return "-"
            rss, pss, uss = (statistics.mean(r[k] for r in rows) / mib for k in range(3))
            return f"{rss:5.0f}/{pss:5.0f}/{uss:5.0f}" + (f" x{len(rows)}" if len(rows) > 1 else "")

        first = f"{self.first_step:7.1f}" if self.first_step is not None else "      -"
        rate = f"{statistics.median(self.rates):6.0f}" if self.rates else "     -"
        return f"  {self.name:<10}{first} s {rate} img/s   trainer {peak('trainer')}   workers {peak('worker')}"


def trainer_run(name: str, data: Path, work: Path, cache: str, log_lines: int) -> Run:
    work.mkdir(parents=True, exist_ok=True)
    flags = [
        *("--device", "cpu", "--nproc", "1", "--image_size", "32", "--batch_size", "64"),
        *("--train_dir", str(data / "train"), "--val_dir", str(data / "val")),
        *(
            "--epochs",
            "1",
            "--num_workers",
            "4",
            "--log_interval",
            str(LOG_INTERVAL),
            "--overwrite",
        ),
        *("--cache_images", cache),
    ]
    (work / "timeline.txt").unlink(missing_ok=True)
    return Run(name, launcher_command(*flags), work, timeline_env(work / "timeline.txt"), log_lines)


def timm_run(train_py: Path, data: Path, work: Path, classes: int, log_lines: int) -> Run:
    work.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        str(train_py),
        *("--device", "cpu", "--data-dir", str(data), "--train-split", "train"),
        *("--val-split", "val", "--model", "resnet18", "--num-classes", str(classes)),
        *(
            "--img-size",
            "32",
            "-b",
            "64",
            "--epochs",
            "1",
            "-j",
            "4",
            "--log-interval",
            str(LOG_INTERVAL),
        ),
        *("--opt", "adamw", "--lr", "0.001", "--no-prefetcher", "--output", str(work / "out")),
    ]
    return Run("timm", command, work, {}, log_lines)


def index_bytes(data: Path) -> tuple[int, int]:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            INDEX_PROBE,
            str(ROOT / "src"),
            str(data / "train"),
            str(data / "val"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    grown, count = result.stdout.split()
    return int(grown), int(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=RUNS)
    parser.add_argument("--timm_train", type=Path, help="timm's train.py (pytorch-image-models)")
    parser.add_argument("--distinct", type=int, default=512, help="distinct JPEG files")
    parser.add_argument("--log_lines", type=int, default=3, help="logged steps before stopping")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    args = parser.parse_args()
    runs = [r for r in args.runs if r != "timm" or args.timm_train]
    print("first step (s), images/s, memory peaks RSS/PSS/USS MiB (workers: the mean)")
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
            started = time.time()
            data = build_tree(Path(tmp) / "data", size, args.distinct)
            classes = max(1, size // PER_CLASS)
            print(f"{size} images, {classes} classes (built in {time.time() - started:.0f} s)")
            grown, count = index_bytes(data)
            print(f"  index of {count} files in one process: {grown / 2**20:.0f} MiB", flush=True)
            ours = Path(tmp) / "trainer"
            for name in runs:
                if name == "timm":
                    run = timm_run(
                        args.timm_train, data, Path(tmp) / "timm", classes, args.log_lines
                    )
                else:
                    cache, start = name.split("-")
                    if start == "cold" and ours.exists():
                        ours = Path(tmp) / f"trainer_{name}"
                    run = trainer_run(name, data, ours, cache, args.log_lines)
                run.go(args.timeout)
                print(run.row(), flush=True)
                if run.first_step is None:
                    print("".join(run.output[-15:]))


if __name__ == "__main__":
    main()

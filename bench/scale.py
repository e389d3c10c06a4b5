#!/usr/bin/env python
"""Start-up at scale: 10k, 100k, 1M tiny JPEGs as a folder and as tar shards, the trainer beside
timm's train.py.

    git -C /work/.mirror/huggingface+pytorch-image-models/repo show HEAD:train.py > /tmp/timm_train.py
    python bench/scale.py --timm_train /tmp/timm_train.py                 # 10k, 100k, 1M
    python bench/scale.py --sizes 10000 --timm_train /tmp/timm_train.py --keep /work/benchdata
    python bench/scale.py --sizes 1000000 --layouts shards --runs auto-cold auto-warm
    python bench/scale.py --sizes 1000000 --keep /work/benchdata --build_only   # data only
    python bench/scale.py --sizes 1000000 --keep /work/benchdata --runs         # index probes only

timm's train.py is that of pytorch-image-models (any clone: ``train.py`` at its top; the
installed ``timm`` package does not ship it). Its HEAD takes ``--device cpu``; its workers
count ``-j 4``. Without ``--timm_train`` the timm run is left out.

The data, per size, in a temporary folder (never committed), or built once into ``--keep DIR``
(``DIR/<size>/``) and reused by every later invocation with the same ``--keep``:

  * folder: ``train/<class>/`` with 100 images a class and ``val/<class>/`` with one a class:
    ``--distinct`` different 40x32 JPEGs (default 512) hard-linked across the tree. Every path
    is its own directory entry, stat and decode, as in a real folder, but the page cache holds
    the few distinct files: reads cost no disk time.
  * shards: the same images as WebDataset tar shards, written by the project's converter
    (``src/prepare_data.py --format shards --shard_size``, from ``source/<class>/``: each
    class's val image and a link to its train folder, split again at --val_ratio 0.01: the same
    100 train + 1 val images a class, one val image drawn by the split). Its time is printed.

Then, per layout, the index each process holds: a fresh interpreter that has imported torch and
the trainer's data modules, as a rank has, opens the train and val data as the trainer does
(``layouts.open_datasets``); printed: entries, its RSS growth, its peak growth (VmHWM, reset
first), the bytes of the table's arrays, and the listing time, twice: first (for shards: no
member index beside them, the tars scanned) and again (the index and directory entries cached).

Then, one after the other on the same machine (ratios side by side in one run), each of:

  * timm:       timm's train.py (``--timm_train``) on the folder only, 4 loader workers;
  * auto-cold:  the launcher, 1 CPU process, ``--cache_images auto``, a fresh log folder (the
                decode check from scratch; for shards, their member indices removed first);
  * auto-warm:  the same again in the same folders (the check and the indices remembered);
  * none-warm:  ``--cache_images none``, the check remembered;

each at 32 px, batch 64, 4 loader workers, stopped (SIGTERM) after ``--log_lines`` logged
training steps; the trainer reads ``--train_data``/``--val_data`` (the folders, or the shard
patterns). Printed per run: seconds from the command's start to the end of the first training
step (the trainer's timeline; timm's first "Train:" line) and its ratio to timm's, images/s
(the median of the logged steps' own figures), and the resident memory of the training process
and of its loader workers, each sampled every 0.5 s and the peak kept: RSS, PSS (shared pages
divided among the processes that map them) and USS (pages of that process alone; a worker that
touches the Python lists it inherited copies them: pytorch/pytorch#13246), from
/proc/<pid>/smaps_rollup. Other work on the machine slows every figure: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
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
sys.path.insert(0, str(ROOT / "tests"))  # support/: what the tests and the benchmarks share

from instrument.sitecustomize import timeline_env  # noqa: E402

from support.harness import child_env, descendants, launcher_command  # noqa: E402

PER_CLASS = 100
LOG_INTERVAL = 5  # steps between the logged figures images/s is read from
RUNS = ["timm", "auto-cold", "auto-warm", "none-warm"]
LAYOUTS = ["folder", "shards"]
TRAINER_STEP = re.compile(r"step \d+/\d+ .* (\d+) img/s")
TIMM_STEP = re.compile(r"Train: \d+ \[\s*(\d+)/.*?,\s*([\d.]+)/s\s+\(")
BUILT = "built.json"  # written last: a tree or shard set without it is rebuilt
SHARD_INDEX = ".imgtrainer-index"  # data.shards.INDEX_SUFFIX (not imported: no package here)

INDEX_PROBE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import torch, torchvision  # what a rank has imported before it lists its data
import imgtrainer.data.loaders
from pathlib import Path
from imgtrainer.data.layouts import open_datasets
from imgtrainer.distributed.setup import cpu_cores_available

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def array_bytes(table):
    arrays = [table.container, table.members.data, table.members.ends]
    arrays += [table.offsets, table.sizes, table.labels]
    return sum(a.nbytes for a in arrays if a.strides != (0,))  # (0,): an unused column

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM from here
before = status("VmRSS")
started = time.perf_counter()
tables = open_datasets(sys.argv[2], sys.argv[3], "", Path(sys.argv[4]), cpu_cores_available())
took = time.perf_counter() - started
grown, peak = status("VmRSS") - before, status("VmHWM") - before
print(sum(map(len, tables)), grown, peak, sum(map(array_bytes, tables)), took)
"""


def write_distinct(folder: Path, distinct: int) -> list[str]:
    """``distinct`` different 40x32 JPEGs of random blocks: the files every entry links to."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for k in range(distinct):
        pixels = rng.integers(0, 256, (8, 10, 3), dtype=np.uint8)
        Image.fromarray(pixels).resize((40, 32)).save(folder / f"{k}.jpg", quality=85)
    return [str(folder / f"{k}.jpg") for k in range(distinct)]


def build_tree(root: Path, images: int, distinct: int) -> None:
    """``root/train`` (``images`` files, PER_CLASS a class), ``root/val`` (one a class), and
    ``root/source/<class>/`` for the converter: the class's val image and a link ``train`` to
    its train folder (prepare_data follows it). The link system calls are the cost: about 20 s
    for a million entries on 2 busy cores; --keep builds it once."""
    files = write_distinct(root / "distinct", distinct)
    classes = max(1, images // PER_CLASS)
    width = len(str(classes - 1))
    names = [f"img_{i:03d}.jpg" for i in range(PER_CLASS)]
    train, val, source = (str(root / part) for part in ("train", "val", "source"))
    for folder in (train, val, source):
        os.mkdir(folder)
    link, n = os.link, 0
    for c in range(classes):
        name = f"class_{c:0{width}d}"
        there = f"{train}/{name}"
        os.mkdir(there)
        for file in names:
            link(files[n % distinct], f"{there}/{file}")
            n += 1
        os.mkdir(f"{val}/{name}")
        os.mkdir(f"{source}/{name}")
        link(files[(n + c) % distinct], f"{val}/{name}/img_val.jpg")
        link(files[(n + c) % distinct], f"{source}/{name}/img_val.jpg")
        os.symlink(there, f"{source}/{name}/train")


def convert_shards(root: Path, shard_size: int) -> dict[str, str]:
    """``root/shards/{train,val}/`` by ``src/prepare_data.py --format shards``, as a user makes
    them; returns the ``--train_data`` / ``--val_data`` it prints."""
    command = [sys.executable, str(ROOT / "src" / "prepare_data.py"), "--format", "shards"]
    command += ["--source", str(root / "source"), "--output", str(root / "shards")]
    command += ["--val_ratio", "0.01", "--shard_size", str(shard_size), "--force"]
    done = subprocess.run(command, capture_output=True, text=True)
    said = [line for line in done.stdout.splitlines() if line.startswith("Train with:")]
    if done.returncode != 0 or not said:
        sys.exit(f"prepare_data.py failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    words = shlex.split(said[0])
    return {
        "train": words[words.index("--train_data") + 1],
        "val": words[words.index("--val_data") + 1],
    }


def stored(marker: Path, wanted: dict) -> dict | None:
    """What ``marker`` recorded when it was written for ``wanted``, else None."""
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return found if all(found.get(k) == v for k, v in wanted.items()) else None


def prepare(root: Path, size: int, args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """The data of one size under ``root``, built unless a build with the same parameters is
    there (``--keep``): ``{layout: {"train": ..., "val": ...}}``; prints what it took."""
    classes = max(1, size // PER_CLASS)
    wanted = {"images": size, "distinct": args.distinct, "per_class": PER_CLASS}
    if stored(root / BUILT, wanted) is None:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        started = time.perf_counter()
        build_tree(root, size, args.distinct)
        (root / BUILT).write_text(json.dumps(wanted))
        built = f"tree built in {time.perf_counter() - started:.1f} s"
    else:
        built = f"tree reused from {root}"
    print(f"{classes * PER_CLASS} train + {classes} val images, {classes} classes ({built})")
    data = {"folder": {"train": str(root / "train"), "val": str(root / "val")}}
    if "shards" in args.layouts:
        wanted = {**wanted, "shard_size": args.shard_size}
        found = stored(root / "shards" / BUILT, wanted)
        if found is None:
            started = time.perf_counter()
            specs = convert_shards(root, args.shard_size)
            took = time.perf_counter() - started
            (root / "shards" / BUILT).write_text(json.dumps({**wanted, **specs}))
            print(f"  shards: prepare_data.py --format shards took {took:.1f} s", flush=True)
        else:
            specs = {role: found[role] for role in ("train", "val")}
            print(f"  shards: reused from {root / 'shards'}")
        data["shards"] = specs
    return data


def forget_shard_indices(root: Path) -> None:
    """Remove the member indices the trainer keeps beside the shards: the next start scans."""
    for index in (root / "shards").rglob(f"*{SHARD_INDEX}"):
        index.unlink()


def index_probe(data: dict[str, str], work: Path) -> str:
    """One fresh rank-like interpreter opening the train and val data: its index, one line."""
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", INDEX_PROBE, str(ROOT / "src"), data["train"], data["val"]]
    done = subprocess.run([*command, str(work)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1:]}"
    count, grown, peak, arrays, took = done.stdout.split()
    mib = 2**20
    return (
        f"{int(count)} entries, RSS +{int(grown) / mib:.0f} MiB (peak +{int(peak) / mib:.0f}), "
        f"arrays {int(arrays) / mib:.1f} MiB, listed in {float(took):.2f} s"
    )


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

    def row(self, layout: str, timm_first: float | None) -> str:
        mib = 2**20

        def peak(role: str) -> str:
            rows = [v for pid, v in self.peaks.items() if self.roles.get(pid) == role]
            if not rows:
                return "-"
            rss, pss, uss = (statistics.mean(r[k] for r in rows) / mib for k in range(3))
            return f"{rss:5.0f}/{pss:5.0f}/{uss:5.0f}" + (f" x{len(rows)}" if len(rows) > 1 else "")

        first = f"{self.first_step:7.1f}" if self.first_step is not None else "      -"
        ratio = "     "
        if self.first_step is not None and timm_first:
            ratio = f"{self.first_step / timm_first:4.2f}x"
        rate = f"{statistics.median(self.rates):6.0f}" if self.rates else "     -"
        return (
            f"  {layout:<7}{self.name:<10}{first} s {ratio} {rate} img/s   "
            f"trainer {peak('trainer')}   workers {peak('worker')}"
        )


def trainer_run(name: str, data: dict[str, str], work: Path, cache: str, log_lines: int) -> Run:
    work.mkdir(parents=True, exist_ok=True)
    flags = [
        *("--device", "cpu", "--nproc", "1", "--image_size", "32", "--batch_size", "64"),
        *("--train_data", data["train"], "--val_data", data["val"]),
        *("--epochs", "1", "--num_workers", "4", "--log_interval", str(LOG_INTERVAL)),
        *("--overwrite", "--cache_images", cache),
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
        *("--img-size", "32", "-b", "64", "--epochs", "1", "-j", "4"),
        *("--log-interval", str(LOG_INTERVAL), "--opt", "adamw", "--lr", "0.001"),
        *("--no-prefetcher", "--output", str(work / "out")),
    ]
    return Run("timm", command, work, {}, log_lines)


def show(run: Run, layout: str, timm_first: float | None) -> None:
    print(run.row(layout, timm_first), flush=True)
    if run.first_step is None:
        print("".join(run.output[-15:]))


def bench_layout(
    layout: str, data: dict[str, str], root: Path, work: Path, args: argparse.Namespace
) -> float | None:
    """The index probes and the runs of one layout; returns timm's first step (folder)."""
    for when in ("first", "again"):
        if layout == "shards" and when == "first":
            forget_shard_indices(root)
        print(f"  {layout:<7}index ({when}): {index_probe(data, work / 'probe')}", flush=True)
    timm_first = args.timm_first
    ours, said = work / layout, False
    for name in args.runs:
        if name == "timm":
            if layout != "folder":
                continue  # timm's train.py reads the folder only
            classes = len(os.listdir(data["train"]))
            run = timm_run(args.timm_train, root, work / "timm", classes, args.log_lines)
        else:
            cache, start = name.split("-")
            if start == "cold":
                ours = work / f"{layout}_{name}"  # a fresh log folder: the decode check redone
                if layout == "shards":
                    forget_shard_indices(root)
            run = trainer_run(name, data, ours, cache, args.log_lines)
        run.go(args.timeout)
        if name == "timm":
            timm_first = run.first_step
        read = [line for line in run.output if "Training data:" in line]
        if read and not said:
            said = True  # what the trainer read, as it logs it, once a layout
            print(f"  {layout:<7}{read[0].split('Training data:', 1)[1].strip()}")
        show(run, layout, timm_first)
    return timm_first


def bench_size(size: int, root: Path, work: Path, args: argparse.Namespace) -> None:
    data = prepare(root, size, args)
    args.timm_first = None
    for layout in args.layouts:
        args.timm_first = bench_layout(layout, data[layout], root, work, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=LAYOUTS)
    parser.add_argument(
        "--runs", nargs="*", choices=RUNS, default=RUNS, help="none: the index probes only"
    )
    parser.add_argument("--timm_train", type=Path, help="timm's train.py (pytorch-image-models)")
    parser.add_argument("--distinct", type=int, default=512, help="distinct JPEG files")
    parser.add_argument("--shard_size", type=int, default=10_000, help="images a tar shard")
    parser.add_argument("--log_lines", type=int, default=3, help="logged steps before stopping")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    parser.add_argument(
        "--keep", type=Path, help="build the data once into KEEP/<size>/ and reuse it from there"
    )
    parser.add_argument(
        "--build_only", action="store_true", help="build the data (into --keep) and stop"
    )
    args = parser.parse_args()
    if args.build_only and not args.keep:
        sys.exit("--build_only builds into --keep DIR: give it")
    args.layouts = [layout for layout in LAYOUTS if layout in args.layouts]  # folder first: timm
    args.runs = [r for r in args.runs if r != "timm" or args.timm_train]
    if args.timm_train and not args.timm_train.is_file():
        sys.exit(f"--timm_train {args.timm_train} does not exist (see this script's docstring)")
    print(
        "first step (s), its ratio to timm's, images/s, memory peaks RSS/PSS/USS MiB "
        "(workers: the mean)"
    )
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
            root = args.keep / str(size) if args.keep else Path(tmp) / "data"
            if args.build_only:
                prepare(root, size, args)
            else:
                bench_size(size, root, Path(tmp) / "work", args)


if __name__ == "__main__":
    main()

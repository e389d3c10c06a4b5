#!/usr/bin/env python
"""How long a launcher run takes to start and to end, next to what importing torch costs, and a
short run against timm, side by side on this machine.

    python bench/startup.py                          # the digits demo at 32 px, 1 process
    python bench/startup.py --nproc 2
    python bench/startup.py --timm_train ~/pytorch-image-models/train.py
    python bench/startup.py --timm_train train.py --repeat 3   # medians of 3 rounds (a busy machine)
    python bench/startup.py --start_method spawn     # the launcher's workers started afresh

Prints:
  * ``python -c "import torch, torchvision, timm"``, measured before and after the runs;
  * the time from starting the launcher to the end of the first training step, for a first start
    (no decode-check cache) and a second one, with the phases in between (launcher, torchrun's
    agent, the worker's imports, process group, data scan and check, image cache, model);
  * the end: from the last line the main rank logs to the launcher's exit, by phase;
  * the wall time of 3 epochs through the launcher against timm's own ``train.py`` with the same
    settings (model, image size, batch size, epochs, optimizer, 2 loader workers). timm's pip
    package does not ship train.py: give its path with --timm_train (from a clone of
    pytorch-image-models); without it the comparison is against a minimal one-process loop built
    from timm's own data pipeline, optimizer and model, and says so.

The phases come from the timeline the launcher, torchrun's agent and the ranks write when
bench/instrument/sitecustomize.py, on their PYTHONPATH, wraps the functions that end each phase. Other work on the machine slows every
number: compare the ratios, and on a busy machine take the medians of several rounds
(``--repeat``; each round measures the import, both launcher starts and timm side by side, in
fresh folders).

timm's train.py of the pytorch-image-models repository at the time of writing hard-codes a CUDA
device in two places (its loaders' ``device=torch.device('cuda')``); for the CPU replace both with
``torch.device('cuda' if torch.cuda.is_available() else 'cpu')``. The device itself goes through
timm's ``-c`` config file (older train.py versions have no ``--device`` flag).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support/: what the tests and the benchmarks share

from instrument.sitecustomize import timeline_env  # noqa: E402

from imgtrainer.data.demo import write_demo_dataset  # noqa: E402
from support.harness import run_launcher  # noqa: E402

RUN_TIMEOUT = 3600  # seconds: a launcher run on a busy machine

START_PHASES = [  # (name, event that ends it); each phase starts where the previous one ended
    ("launcher (python, flags, checks)", "torchrun start"),
    ("torchrun agent: python, imports (fork: the trainer's)", "agent imports done"),
    ("torchrun agent: rendezvous, start the workers", "worker start"),
    ("worker imports (spawn: torch, torchvision, timm)", "imports done"),
    ("process group", "process group ready"),
    ("GPU image cache (decode every image first)", "images cached"),
    ("data listing (the decode check then runs beside training)", "data check started"),
    ("model, optimizer, resume", "model ready"),
    ("first training step", "first step done"),
]
END_PHASES = [
    ("process group teardown", "process group destroyed"),
    ("worker exit (interpreter teardown)", "worker exit"),
    ("torchrun agent notices and exits", "torchrun exited"),
    ("launcher exit", "launcher exit"),
]

MINIMAL_TIMM_LOOP = r"""
import sys, time
import torch, timm
from timm.data import create_dataset, create_loader
from timm.optim import create_optimizer_v2

train_dir, val_dir, epochs, batch, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
train = create_dataset("", root=train_dir, is_training=True)
val = create_dataset("", root=val_dir)
# On the CPU, as timm's train.py runs there (--device cpu --no-prefetcher).
cpu = dict(use_prefetcher=False, device=torch.device("cpu"), num_workers=workers,
           persistent_workers=True)
train_loader = create_loader(train, input_size=(3, 32, 32), batch_size=batch, is_training=True, **cpu)
val_loader = create_loader(val, input_size=(3, 32, 32), batch_size=batch, is_training=False, **cpu)
model = timm.create_model("resnet18", num_classes=len(train.reader.class_to_idx))
optimizer = create_optimizer_v2(model, "adamw", lr=0.001, weight_decay=0.01)
loss_fn = torch.nn.CrossEntropyLoss()
for epoch in range(epochs):
    model.train()
    for images, targets in train_loader:
        loss = loss_fn(model(images), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for images, targets in val_loader:
            correct += (model(images).argmax(1) == targets).sum().item()
    print(f"epoch {epoch + 1}: val_acc {correct / len(val):.3f}", flush=True)
"""


def timed(command: list[str], **kwargs) -> tuple[float, subprocess.CompletedProcess]:
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    return time.time() - started, succeeded(command, result)


def succeeded(command: list, result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if result.returncode != 0:
        sys.exit(
            f"{command[:3]} failed ({result.returncode}):\n{result.stdout[-2000:]}\n"
            f"{result.stderr[-2000:]}"
        )
    return result


def import_seconds() -> float:
    return timed([sys.executable, "-c", "import torch, torchvision, timm"])[0]


def launcher_run(
    data: Path,
    work: Path,
    nproc: int,
    epochs: int,
    batch: int,
    workers: int | None,
    start_method: str = "auto",
) -> dict[str, float]:
    """One launcher run; returns {event: seconds since the launcher was started}."""
    timeline = work / f"timeline_{time.time_ns()}.txt"
    flags = [
        "--device",
        "cpu",
        "--nproc",
        str(nproc),
        "--train_dir",
        str(data / "train"),
        "--val_dir",
        str(data / "val"),
        "--image_size",
        "32",
        "--batch_size",
        str(batch),
        "--epochs",
        str(epochs),
        "--learning_rate",
        "0.001",
        "--optimizer",
        "adamw",
        "--log_interval",
        "50",
        "--overwrite",  # the second start reuses the first one's folders
        "--start_method",
        start_method,
    ]
    if workers is not None:
        flags += ["--num_workers", str(workers)]
    started = time.time()
    result = run_launcher(flags, work, timeout=RUN_TIMEOUT, env=timeline_env(timeline))
    events = {"launcher exit": time.time() - started}
    succeeded(["launch_ddp.py", *flags], result)
    for line in timeline.read_text().splitlines():
        stamp, who, event = line.split(" ", 2)
        if who in ("launcher", "agent", "rank0"):
            events.setdefault(event, float(stamp) - started)
    return events


def phases(
    events: dict[str, float], table: list[tuple[str, str]], start: float
) -> list[tuple[str, float]]:
    rows, previous = [], start
    for name, event in table:
        if event in events:
            rows.append((name, events[event] - previous))
            previous = events[event]
    return rows


def show_start(title: str, events: dict[str, float], imports: float) -> None:
    first = events["first step done"]
    print(
        f"{title}: launcher start -> end of first step {first:.2f} s "
        f"= {first / imports:.2f} x the import time ({imports:.2f} s)"
    )
    for name, seconds in phases(events, START_PHASES, 0.0):
        print(f"    {name:<56}{seconds:6.2f} s")


def show_end(events: dict[str, float]) -> None:
    last = events["summary logged"]
    print(f"end: last rank log line -> launcher exit {events['launcher exit'] - last:.2f} s")
    for name, seconds in phases(events, END_PHASES, last):
        print(f"    {name:<56}{seconds:6.2f} s", flush=True)


def timm_run(args: argparse.Namespace, data: Path, work: Path) -> tuple[str, float]:
    if args.timm_train:
        # The device through timm's -c config file: older train.py versions have no --device.
        device_file = work / "timm_device.yaml"
        device_file.write_text("device: cpu\n")
        command = [
            sys.executable,
            str(args.timm_train),
            "-c",
            str(device_file),
            "--data-dir",
            str(data),
            "--train-split",
            "train",
            "--val-split",
            "val",
            "--model",
            "resnet18",
            "--num-classes",
            "10",
            "--img-size",
            "32",
            "-b",
            str(args.batch_size),
            "--epochs",
            str(args.epochs),
            "-j",
            "2",
            "--opt",
            "adamw",
            "--lr",
            "0.001",
            "--weight-decay",
            "0.01",
            "--sched",
            "cosine",
            "--warmup-epochs",
            "0",
            "--no-prefetcher",
            "--output",
            str(work / "timm_output"),
        ]
        return "timm's train.py", timed(command, cwd=work)[0]
    command = [
        sys.executable,
        "-c",
        MINIMAL_TIMM_LOOP,
        str(data / "train"),
        str(data / "val"),
        str(args.epochs),
        str(args.batch_size),
        "2",
    ]
    return (
        "a minimal one-process timm loop (timm's train.py not given: --timm_train)",
        timed(command, cwd=work)[0],
    )


def one_round(args: argparse.Namespace, data: Path, work: Path, images: int) -> dict[str, float]:
    """Import, first start with 3 epochs, timm, second start, import again: side by side."""
    before = import_seconds()
    print(f"python -c 'import torch, torchvision, timm': {before:.2f} s", flush=True)
    runs = (data, work, args.nproc)
    cold = launcher_run(*runs, args.epochs, args.batch_size, args.num_workers, args.start_method)
    show_start("first start (decode check from scratch)", cold, before)
    show_end(cold)
    timm_name, timm_seconds = timm_run(args, data, work)
    print(
        f"{args.epochs} epochs of {images} digits at 32 px, batch {args.batch_size}: "
        f"launcher ({args.nproc} process(es)) {cold['launcher exit']:.1f} s, "
        f"{timm_name} {timm_seconds:.1f} s: ratio {cold['launcher exit'] / timm_seconds:.2f}",
        flush=True,
    )
    warm = launcher_run(*runs, 1, args.batch_size, args.num_workers, args.start_method)
    after = import_seconds()
    print(f"python -c 'import torch, torchvision, timm' again: {after:.2f} s", flush=True)
    imports = (before + after) / 2
    show_start("second start (decode check remembered)", warm, imports)
    show_end(warm)
    return {
        "import (s)": imports,
        "first start / import": cold["first step done"] / before,
        "second start / import": warm["first step done"] / imports,
        "end, first run (s)": cold["launcher exit"] - cold["summary logged"],
        "launcher 3 epochs (s)": cold["launcher exit"],
        "timm 3 epochs (s)": timm_seconds,
        "launcher / timm": cold["launcher exit"] / timm_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=1, help="launcher processes (default: 1)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument(
        "--num_workers",
        type=int,
        default=None,
        help="the launcher run's loader workers (default: the trainer's choice)",
    )
    parser.add_argument(
        "--start_method",
        choices=["auto", "fork", "spawn"],
        default="auto",
        help="the launcher's --start_method (default: auto)",
    )
    parser.add_argument(
        "--timm_train",
        type=Path,
        default=None,
        help="timm's train.py, from a clone of pytorch-image-models",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds, each in fresh folders; prints the medians"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        data = Path(tmp) / "digits"
        write_demo_dataset(data)
        images = sum(1 for _ in (data / "train").rglob("*.png"))
        rounds = []
        for number in range(args.repeat):
            if args.repeat > 1:
                print(f"--- round {number + 1} of {args.repeat}", flush=True)
            work = Path(tmp) / f"round{number}"
            work.mkdir()
            rounds.append(one_round(args, data, work, images))
        if args.repeat > 1:
            print(f"--- medians of {args.repeat} rounds (each value: its rounds in order)")
            for key in rounds[0]:
                values = [r[key] for r in rounds]
                listed = ", ".join(f"{v:.2f}" for v in values)
                print(f"    {key:<28}{statistics.median(values):7.2f}   ({listed})")


if __name__ == "__main__":
    main()

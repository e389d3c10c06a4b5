"""A run's log folder written by hand, as a 2-process run with EMA leaves it: for the report
page's tests and its benchmark (bench/report_page.py). numpy only: no torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from imgtrainer.reports.predictions import BEST_PREDICTIONS, Predictions


def write_log_folder(
    folder: Path,
    classes: list[str],
    epochs: int,
    images_per_class: int,
    val_dir: Path | None = None,
) -> None:
    """A log folder as a 2-process run with EMA leaves it, resumed once, with fields added by
    other parts of the trainer (the data audit, per-rank figures) and one unknown to the
    report; its validation images ``val_dir/<class>/img_NNN.jpg`` (as ``write_photo_folder``
    names them; by default a folder that does not exist)."""
    rng = np.random.default_rng(0)
    val = str(val_dir or folder / "no-such-val")
    records = []
    for e in range(1, epochs + 1):
        acc = 1 - 0.5 / e
        records.append(
            {
                "epoch": e,
                "train_loss": 1 / e,
                "train_acc": acc,
                "val_loss": 1.1 / e,
                "val_acc": acc - 0.02,
                "val_top5": 1.0,
                "val_loss_ema": 1.05 / e,
                "val_acc_ema": acc - 0.01,
                "val_top5_ema": 1.0,
                "lr": 0.1 / e,
                "epoch_seconds": 10.0 + e,
                "train_images_per_sec": 500.0,
                "peak_memory_mb": 900.0,
                "micro_batch": 64,
                "data_wait_share": 0.05,
                "rank0_step_s": 0.1,
                "rank1_step_s": 0.12,
                "rank0_data_wait_share": 0.04,
                "rank1_data_wait_share": 0.2,
                "audit_images": 3,
                "audit_max_diff": 4.2 if e == 2 else 0.0,
                "made_up_by_a_later_version": 42.5,
            }
        )
    history = {
        "config": {
            "model": "resnet18",
            "epochs": epochs,
            "val_dir": val,
            "checkpoint_dir": str(folder / "checkpoints"),
            "train_dir": "data/train",
            "audit_data_every": 100,
        },
        "world_size": 2,
        "device": "cpu",
        "class_names": classes,
        "train_class_counts": [int(c) for c in rng.integers(5, 50, len(classes))],
        "command": ["src/train_ddp.py", "--model_ema"],
        "versions": {"torch": "x"},
        "environment": {"host": "h", "precision": "float32", "gpus": []},
        "best": {
            "metric": "val_acc",
            "value": records[-1]["val_acc_ema"],
            "epoch": epochs,
            "weights": "ema",
        },
        "epochs": records,
        "events": run_events(),
    }
    (folder / "training_history.json").write_text(json.dumps(history))
    k = len(classes)
    targets = np.repeat(np.arange(k), images_per_class)
    n = len(targets)
    predicted = np.where(rng.random(n) < 0.7, targets, rng.integers(0, k, n))
    Predictions(
        list(classes),
        [f"{val}/{classes[t]}/img_{i % images_per_class:03d}.jpg" for i, t in enumerate(targets)],
        targets,
        predicted,
        rng.random(n).astype(np.float32),
        rng.exponential(1.0, n).astype(np.float32),
        {"epoch": epochs, "weights": "ema"},
    ).save(folder / BEST_PREDICTIONS)
    # The checkpoints as files the page lists (it reads their size and time, not them).
    (folder / "checkpoints").mkdir()
    for name in ("checkpoint_best.pth", "checkpoint_latest.pth"):
        (folder / "checkpoints" / name).write_bytes(b"not read")
    (folder / "unreadable_images.txt").write_text("val/cat/broken.jpg\tcannot identify image\n")
    (folder / "hang").mkdir()
    (folder / "hang" / "attempt0-rank1.txt").write_text("stacks")
    launcher = [
        {
            "kind": "launch",
            "time": "2026-01-01T09:59:58",
            "command": "python -m torch.distributed.run",
        },
        {"kind": "hang", "time": "2026-01-01T10:05:30", "rank": 1, "attempt": 0, "text": HANG},
    ]
    (folder / "launcher_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in launcher))


RERUN = "python launch_ddp.py --config logs/config.yaml"
HANG = "watchdog: rank 1 (pid 7) made no progress for 60 s"


def run_events() -> list[dict]:
    """The events of a run started, resumed once by the user, and done (``imgtrainer.events``)."""
    start = {
        "kind": "start",
        "attempt": 0,
        "rerun": RERUN,
        "text": f"Configuration: (rerun: {RERUN})",
    }
    return [
        {**start, "time": "2026-01-01T10:00:00"},
        {
            "kind": "data",
            "time": "2026-01-01T10:00:01",
            "role": "Training",
            "images": 100,
            "text": "Training data: 100 images in 3 classes from a folder x",
        },
        {
            "kind": "audit",
            "level": "WARNING",
            "time": "2026-01-01T10:04:00",
            "text": "data audit: train/cat/a.jpg made from gpu on cuda:0 differs from the CPU "
            "reference by 4.2 levels (tolerance 3)",
        },
        {
            "kind": "straggler",
            "level": "WARNING",
            "time": "2026-01-01T10:05:00",
            "text": "straggler: rank 1 on host h spends 0.2 s",
        },
        {**start, "time": "2026-01-01T10:06:00", "until": "2026-01-01T10:09:00"},
        {
            "kind": "resume",
            "time": "2026-01-01T10:06:02",
            "by": "user",
            "epoch": 2,
            "text": "Resumed from checkpoints/checkpoint_latest.pth: epoch 2",
        },
        {
            "kind": "done",
            "time": "2026-01-01T10:09:00",
            "finished": True,
            "text": "Done: best val_acc 0.9 (EMA weights, epoch 3); ...\n  best checkpoint: x",
        },
    ]

#!/usr/bin/env python
"""What TensorBoard logging costs per training step, as a share of the step.

    python bench/tensorboard_overhead.py                      # ResNet18, 32 px, batch 64, CPU
    python bench/tensorboard_overhead.py --device cuda --image_size 224

Times, in one process, side by side:
  * the training step: timm ResNet18 forward, backward and AdamW step on one synthetic batch
    (float32; median of --steps after warm-up; on CUDA synchronised at the end of each step);
  * ``TensorBoardLogger.add_step_metrics`` with the four per-step metrics (loss, lr, images/s, data
    wait share), --calls times: back to back ("call" counting the calls alone, "with the
    writing" adding the ``close()`` that waits for the background thread to put them all on
    disk; the queue fills, so each call also waits for the writer thread: an upper bound), and
    paced, 2 ms apart, as in training where calls are a step or more apart (calls alone), and
    for comparison torch's ``SummaryWriter.add_scalar`` once per value, paced;
  * ``add_epoch_record`` with a history record of 11 fields (it flushes).
and prints the logging cost as a share of a step at --log_interval 20 (the default) and 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

import timm  # noqa: E402
import torch  # noqa: E402

from imgtrainer.reports.tensorboard import TensorBoardLogger  # noqa: E402


def step_seconds(device: torch.device, image_size: int, batch_size: int, steps: int) -> float:
    model = timm.create_model("resnet18", num_classes=90).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = torch.randn(batch_size, 3, image_size, image_size, device=device)
    targets = torch.randint(0, 90, (batch_size,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(steps + 3):
        sync()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        optimizer.step()
        sync()
        if i >= 3:  # warm-up: allocator, kernels
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def paced_seconds(calls: int, log) -> float:
    """Total time of ``calls`` calls of ``log(step, metrics)``, 2 ms apart (the step in
    between, during which the writer thread keeps up), the calls alone."""
    total = 0.0
    for step in range(1, calls + 1):
        time.sleep(0.002)
        start = time.perf_counter()
        log(
            step, {"loss": 2.0 / step, "lr": 1e-3, "images_per_sec": 380.5, "data_wait_share": 0.03}
        )
        total += time.perf_counter() - start
    return total


def log_step_seconds(calls: int) -> tuple[float, float, float, float, float]:
    """Per add_step_metrics call: back to back, the calls alone and with the writing; paced; paced
    with one add_scalar per value; per add_epoch_record call."""
    with tempfile.TemporaryDirectory() as folder:
        logger = TensorBoardLogger(Path(folder), enabled=True, purge_step=0)
        logger.add_step_metrics(0, {"loss": 1.0})  # the event file is opened lazily
        start = time.perf_counter()
        for step in range(1, calls + 1):
            logger.add_step_metrics(
                step,
                {"loss": 2.0 / step, "lr": 1e-3, "images_per_sec": 380.5, "data_wait_share": 0.03},
            )
        called = time.perf_counter() - start
        logger.close()
        written = time.perf_counter() - start

        logger = TensorBoardLogger(Path(folder) / "paced", enabled=True, purge_step=0)
        logger.add_step_metrics(0, {"loss": 1.0})
        paced = paced_seconds(calls, logger.add_step_metrics)
        # For comparison: SummaryWriter.add_scalar once per value, one event each.
        writer = logger._writer
        per_value = paced_seconds(
            calls,
            lambda step, metrics: [
                writer.add_scalar(f"train/{name}", value, step) for name, value in metrics.items()
            ],
        )
        logger.close()

        logger = TensorBoardLogger(Path(folder) / "epochs", enabled=True, purge_step=0)
        record = {
            "epoch": 1,
            "train_loss": 1.0,
            "train_acc": 0.5,
            "val_loss": 1.1,
            "val_acc": 0.4,
            "val_top5": 0.9,
            "lr": 1e-3,
            "epoch_seconds": 20.0,
            "train_images_per_sec": 380.0,
            "peak_memory_mb": 900.0,
            "micro_batch": 64,
        }
        start = time.perf_counter()
        for epoch in range(1, 21):
            logger.add_epoch_record(epoch * 100, {**record, "epoch": epoch})
        epoch_end = (time.perf_counter() - start) / 20
        logger.close()
    return called / calls, written / calls, paced / calls, per_value / calls, epoch_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own choice)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    step = step_seconds(torch.device(args.device), args.image_size, args.batch_size, args.steps)
    call, written, paced, per_value, epoch_end = log_step_seconds(args.calls)
    print(
        f"training step (ResNet18, {args.image_size} px, batch {args.batch_size}, "
        f"{args.device}, {torch.get_num_threads()} threads): {step * 1e3:.1f} ms (median)"
    )
    print(
        f"add_step_metrics, 4 scalars, {args.calls} calls: back to back {call * 1e6:.1f} us per "
        f"call, {written * 1e6:.1f} us with the writing; paced {paced * 1e6:.1f} us per call "
        f"(SummaryWriter.add_scalar per value, paced: {per_value * 1e6:.1f} us)"
    )
    print(f"add_epoch_record, 11 fields + flush: {epoch_end * 1e6:.1f} us per call")
    for interval in (20, 1):
        print(
            f"share of a step at --log_interval {interval}: "
            f"{100 * paced / interval / step:.4f}% paced, "
            f"{100 * written / interval / step:.4f}% back to back with the writing"
        )


if __name__ == "__main__":
    main()

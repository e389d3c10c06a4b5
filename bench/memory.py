#!/usr/bin/env python
"""Peak memory and speed of training steps: normal mode, --low_memory (which checkpoints the
early layers only) and the same preset with timm's checkpointing of every block, and the budget.

    python bench/memory.py                                   # CPU: ResNet18, 128 px, batch 64
    python bench/memory.py --device cuda --image_size 224    # CUDA: the 2 GB target

Each mode runs in its own process (a process's peak resident memory only grows), built from the
trainer's own pieces on one synthetic batch. The peak is ``torch.cuda.max_memory_allocated`` on
CUDA, and on the CPU the resident high-water mark: whole, above imports, and above the baseline
the fitting measures against (``cpu_baseline``), which is what ``--max_memory_gb`` covers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MIB = 2**20
EVERY_BLOCK = "every_block"  # the mode with timm's checkpointing of every block
MODES = ("normal", "low_memory", EVERY_BLOCK)


def worker(args: argparse.Namespace) -> dict:
    """One mode, in this process; returns its figures."""
    sys.path.insert(0, str(SRC))
    import logging

    import torch  # noqa: F401  (imported here so the baseline below includes it)

    from imgtrainer.config import parse_config
    from imgtrainer.distributed.setup import DistInfo
    from imgtrainer.precision import configure_backends
    from imgtrainer.training.build import build_run_parts
    from imgtrainer.training.loop import train_one_epoch
    from imgtrainer.training.memory_fit import TrialParts, build_memory_plan
    from imgtrainer.training.memory_probes import (
        ResidentMemory,
        cpu_baseline,
        resident_training_state,
    )

    resident = ResidentMemory()
    imports_mib = resident.current() / MIB if resident.available else None

    logging.basicConfig(stream=sys.stderr, format=f"  [{args.worker}] %(message)s")
    logging.getLogger("trainer").setLevel(logging.INFO)
    flags = [
        "--device",
        args.device,
        "--image_size",
        str(args.image_size),
        "--batch_size",
        str(args.batch_size),
        "--model",
        args.model,
    ]
    if args.worker == "low_memory":
        flags += ["--low_memory", "--max_memory_gb", str(args.max_memory_gb)]
    elif args.worker == EVERY_BLOCK:  # the preset's flags, without its early-layers choice
        flags += ["--grad_checkpointing", "--auto_micro_batch", "--prefetch_factor", "1"]
        flags += ["--max_memory_gb", str(args.max_memory_gb)]
        flags += ["--use_amp", "--channels_last"] if args.device == "cuda" else []
    cfg = parse_config(flags)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    torch.set_num_threads(os.cpu_count() or 1)
    configure_backends(device, cfg.deterministic)  # the trainer's kernel choices

    # The trainer's own parts for one process (its seed, savers, optimizer, precision, loss).
    parts = build_run_parts(
        cfg,
        DistInfo(0, 0, 1, 1, device),
        args.num_classes,
        steps_per_epoch=args.warmup + args.steps,
    )
    model, optimizer = parts.model, parts.optimizer
    precision = parts.precision
    # The baseline the fitting takes inside build_memory_plan; in normal mode the same figure
    # without cpu_baseline's allocator setting (the trainer makes it only when fitting).
    baseline = None
    if device.type == "cpu" and resident.available:
        baseline = (
            cpu_baseline(model, optimizer, resident)
            if cfg.auto_micro_batch
            else resident.reset_peak()
            and resident.current() - resident_training_state(model, optimizer)
        )
    parts.plan = build_memory_plan(cfg, TrialParts.of(parts), 1, args.num_classes)

    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g),
        torch.randint(0, args.num_classes, (args.batch_size,), generator=g),
    )
    if device.type == "cuda":
        batch = (batch[0].pin_memory(), batch[1].pin_memory())

    def steps(count: int) -> None:
        train_one_epoch(parts, [batch] * count)

    reset = resident.available and resident.reset_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps(args.warmup)  # the first step also allocates the optimizer state
    started = time.perf_counter()
    steps(args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    result = {
        "mode": args.worker,
        "micro_batch": parts.plan.micro_batch,
        "images_per_sec": args.steps * args.batch_size / seconds,
        "imports_mib": imports_mib,
        "peak_rss_mib": resident.peak() / MIB if resident.available else None,
        "budgeted_peak_mib": ((resident.peak() - baseline) / MIB if baseline is not None else None),
        "budget_mib": args.max_memory_gb * 1024 if args.worker != "normal" else None,
        "peak_reset": reset,
        "precision": str(precision.dtype) if precision.enabled else "float32",
    }
    if device.type == "cuda":
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
    return result


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--device",
        args.device,
        "--image_size",
        str(args.image_size),
        "--batch_size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--model",
        args.model,
        "--num_classes",
        str(args.num_classes),
        "--max_memory_gb",
        str(args.max_memory_gb),
    ]
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def report(args: argparse.Namespace, normal: dict, low: dict, every: dict | None = None) -> None:
    cuda = args.device == "cuda"
    print(
        f"\n{args.model}, {args.image_size} px, batch {args.batch_size} per optimizer step, "
        f"{args.device}, {args.warmup} warm-up + {args.steps} timed steps per mode, "
        f"--low_memory with --max_memory_gb {args.max_memory_gb}"
    )
    header = f"{'mode':<11} {'micro-batch':>11} {'precision':>16}"
    rows = [r for r in (normal, low, every) if r]
    header += (
        f" {'CUDA peak':>12}"
        if cuda
        else f" {'peak RSS':>10} {'above imports':>14} {'budgeted':>10}"
    )
    print(header + f" {'img/s':>8}")
    for r in rows:
        line = f"{r['mode']:<11} {r['micro_batch']:>11} {r['precision']:>16}"
        if cuda:
            line += f" {r['cuda_peak_mib']:>8.0f} MiB"
        else:
            line += (
                f" {r['peak_rss_mib']:>6.0f} MiB"
                f" {r['peak_rss_mib'] - r['imports_mib']:>10.0f} MiB"
                f" {r['budgeted_peak_mib']:>6.0f} MiB"
            )
        print(line + f" {r['images_per_sec']:>8.1f}")
    if every:
        print(
            f"speed vs normal: low_memory {low['images_per_sec'] / normal['images_per_sec']:.2f}, "
            f"{EVERY_BLOCK} {every['images_per_sec'] / normal['images_per_sec']:.2f}"
        )
    speed = low["images_per_sec"] / normal["images_per_sec"]
    budget = args.max_memory_gb * 1024
    if cuda:
        peak = low["cuda_peak_mib"]
        print(
            f"low/normal CUDA peak: {peak / normal['cuda_peak_mib']:.2f}; low-memory peak "
            f"{peak:.0f} MiB against the budget of {budget:.0f} MiB: "
            f"{'within' if peak <= budget else 'OVER'}; speed ratio {speed:.2f}"
        )
        return
    raw = low["peak_rss_mib"] / normal["peak_rss_mib"]
    above = (low["peak_rss_mib"] - low["imports_mib"]) / (
        normal["peak_rss_mib"] - normal["imports_mib"]
    )
    print(f"low/normal peak RSS: {raw:.2f}; above imports: {above:.2f}; speed ratio {speed:.2f}")
    print(
        f"low-memory budgeted peak {low['budgeted_peak_mib']:.0f} MiB against the budget of "
        f"{budget:.0f} MiB: {'within' if low['budgeted_peak_mib'] <= budget else 'OVER'}"
    )
    if not (normal["peak_reset"] and low["peak_reset"]):
        print("note: /proc/self/clear_refs was not writable: peaks include model building")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--image_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=64, help="effective batch per step")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--num_classes", type=int, default=90)
    parser.add_argument(
        "--max_memory_gb",
        type=float,
        default=None,
        help="budget of the --low_memory run (default: 0.5 on the CPU: ResNet18's "
        "weights, gradients and AdamW state take 0.17 of it; 2 on CUDA, the "
        "2 GB GPU target)",
    )
    parser.add_argument(
        "--skip_every_block",
        action="store_true",
        help=f"leave out the {EVERY_BLOCK} mode (timm's checkpointing of every block)",
    )
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_memory_gb is None:
        args.max_memory_gb = 2.0 if args.device == "cuda" else 0.5
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return
    normal = run_mode("normal", args)
    low = run_mode("low_memory", args)
    every = None if args.skip_every_block else run_mode(EVERY_BLOCK, args)
    report(args, normal, low, every)


if __name__ == "__main__":
    main()

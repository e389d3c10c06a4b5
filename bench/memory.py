#!/usr/bin/env python
"""Peak memory and speed of training steps, normal mode vs --low_memory.

    python bench/memory.py                                   # CPU: ResNet18, 128 px, batch 64
    python bench/memory.py --device cuda --image_size 224    # CUDA: the 2 GB target

Each mode runs in its own process, because a process's peak resident memory only grows. Both
use the trainer's own pieces: ``parse_config`` (so ``--low_memory`` is the real preset), the
timm model, the memory savers, optimizer, precision, the memory plan (the fitting included) and
``engine.train_one_epoch``, on one synthetic batch repeated (data loading is the same in both
modes and left out). The peak is taken over the training steps: on the CPU the peak resident set
(VmHWM, reset through /proc/self/clear_refs once the model, optimizer and plan are built), on
CUDA ``torch.cuda.max_memory_allocated``. "above imports" subtracts the resident memory right
after importing torch, torchvision and timm, the same in both modes (~0.7 GB with a CUDA build
of torch) and not memory that training uses.
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


def status_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident set (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(args: argparse.Namespace) -> dict:
    """One mode, in this process; returns its figures."""
    imports_mib = None
    sys.path.insert(0, str(SRC))
    import torch  # noqa: F401  (imported here so the baseline below includes it)
    import logging

    from config import parse_config
    from engine import train_one_epoch
    from memory import build_memory_plan, enable_memory_savers
    from model import build_model
    from train_ddp import build_optimizer, choose_precision
    imports_mib = status_mib("VmRSS")

    logging.basicConfig(stream=sys.stderr, format=f"  [{args.worker}] %(message)s")
    logging.getLogger("trainer").setLevel(logging.INFO)
    flags = ["--device", args.device, "--image_size", str(args.image_size),
             "--batch_size", str(args.batch_size), "--model", args.model]
    if args.worker == "low_memory":
        flags += ["--low_memory", "--max_memory_gb", str(args.max_memory_gb)]
    cfg = parse_config(flags)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)

    model = build_model(cfg.model, args.num_classes)
    enable_memory_savers(model, grad_checkpointing=cfg.grad_checkpointing,
                         channels_last=cfg.channels_last and device.type == "cuda")
    model = model.to(device)
    optimizer = build_optimizer(cfg, model, world_size=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    precision = choose_precision(cfg, device)
    scaler = torch.amp.GradScaler(device.type,
                                  enabled=precision.enabled and precision.dtype == torch.float16)
    criterion = torch.nn.CrossEntropyLoss()
    plan = build_memory_plan(cfg, device, 1, model, optimizer, criterion, precision,
                             args.num_classes)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g),
             torch.randint(0, args.num_classes, (args.batch_size,), generator=g))
    if device.type == "cuda":
        batch = (batch[0].pin_memory(), batch[1].pin_memory())

    def steps(count: int) -> None:
        train_one_epoch(model, [batch] * count, optimizer, scheduler, scaler, criterion, device,
                        precision, show_progress=False, plan=plan)

    reset = reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps(args.warmup)  # the first step also allocates the optimizer state
    started = time.perf_counter()
    steps(args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    result = {"mode": args.worker, "micro_batch": plan.micro_batch,
              "images_per_sec": args.steps * args.batch_size / seconds,
              "imports_mib": imports_mib, "peak_rss_mib": status_mib("VmHWM"),
              "peak_reset": reset, "precision": str(precision.dtype) if precision.enabled
              else "float32"}
    if device.type == "cuda":
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
    return result


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", mode, "--device", args.device,
               "--image_size", str(args.image_size), "--batch_size", str(args.batch_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model,
               "--num_classes", str(args.num_classes), "--max_memory_gb", str(args.max_memory_gb)]
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def report(args: argparse.Namespace, normal: dict, low: dict) -> None:
    cuda = args.device == "cuda"
    print(f"\n{args.model}, {args.image_size} px, batch {args.batch_size} per optimizer step, "
          f"{args.device}, {args.warmup} warm-up + {args.steps} timed steps per mode, "
          f"--low_memory with --max_memory_gb {args.max_memory_gb}")
    header = f"{'mode':<11} {'micro-batch':>11} {'precision':>16}"
    header += f" {'CUDA peak':>12}" if cuda else f" {'peak RSS':>10} {'above imports':>14}"
    print(header + f" {'img/s':>8}")
    for r in (normal, low):
        line = f"{r['mode']:<11} {r['micro_batch']:>11} {r['precision']:>16}"
        if cuda:
            line += f" {r['cuda_peak_mib']:>8.0f} MiB"
        else:
            line += (f" {r['peak_rss_mib']:>6.0f} MiB"
                     f" {r['peak_rss_mib'] - r['imports_mib']:>10.0f} MiB")
        print(line + f" {r['images_per_sec']:>8.1f}")
    speed = low["images_per_sec"] / normal["images_per_sec"]
    if cuda:
        peak = low["cuda_peak_mib"]
        print(f"low/normal CUDA peak: {peak / normal['cuda_peak_mib']:.2f}; low-memory peak "
              f"{peak / 1024:.2f} GiB (target at 224 px: within 2 GiB: "
              f"{'met' if peak <= 2048 else 'missed'}); speed ratio {speed:.2f}")
        return
    raw = low["peak_rss_mib"] / normal["peak_rss_mib"]
    above = ((low["peak_rss_mib"] - low["imports_mib"])
             / (normal["peak_rss_mib"] - normal["imports_mib"]))
    print(f"low/normal peak RSS: {raw:.2f} (target <= 0.50: {'met' if raw <= 0.5 else 'missed'}); "
          f"above imports: {above:.2f} ({'met' if above <= 0.5 else 'missed'}); "
          f"speed ratio {speed:.2f}")
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
    parser.add_argument("--max_memory_gb", type=float, default=None,
                        help="budget of the --low_memory run (default: 0.25 on the CPU, a small "
                             "machine's share at 128 px; 2 on CUDA, the 2 GB GPU target)")
    parser.add_argument("--worker", choices=["normal", "low_memory"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_memory_gb is None:
        args.max_memory_gb = 2.0 if args.device == "cuda" else 0.25
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return
    normal = run_mode("normal", args)
    low = run_mode("low_memory", args)
    report(args, normal, low)


if __name__ == "__main__":
    main()

"""Where does the time of a training step go? The trainer's throughput against the model's ceiling.

    python bench/throughput.py                                   # ResNet18, 32 px, batch 64, 1 and 2 processes
    python bench/throughput.py --image_size 224 --batch_size 32
    python bench/throughput.py -- --cache_images ram             # trainer flags after "--"
    python bench/throughput.py --sources gpu ram none --decode   # each source; JPEG decode rates
    python bench/throughput.py --dataset photos --image_size 224 # mixed-aspect photos >= 500 px
    python bench/throughput.py --world_sizes 1 --policy          # the policies, looped vs grouped
    python bench/throughput.py --world_sizes 1 --step_variants eager compile batch_x2
    python bench/throughput.py --world_sizes 2 --watchdog        # hang watchdog off / on, twice
    python bench/throughput.py --world_sizes 1 --audit           # data audit off / default, twice

For each world size it runs, as separate torchrun jobs with the same threads per process:

1. ceiling: a bare loop of forward, backward and optimizer step of the same model, batch, image
   size and precision on tensors already in memory (DDP at world size > 1, no loader);
2. trainer: the real training path (the trainer's loader, transforms, sampler, AMP setting, DDP
   wrapper, metrics, progress bar, step hooks) on a generated ImageFolder of JPEG files
   (``--dataset``: square noise patches, or photo-like mixed-aspect photos, the default on CUDA;
   tests/support/harness.py's ``write_split_folder``).

With ``--watchdog``, the trainer runs ``--pairs`` times per source without and with the
hang watchdog, alternating (each rank's and loader worker's heartbeat slot written, read by a
watchdog thread of this process as the launcher's would), and prints their rates side by side
and the cost of each heartbeat call.
``--audit`` alternates the same way the data audit off (``--audit_data_every 0``) and at its
default rate (the first 3 batches, then every 100th): what the audit costs when it is not
auditing.
With ``--sources``, the trainer runs once per image source (``--cache_images`` gpu, ram, none)
against the same ceiling. ``--decode`` measures JPEG decoding alone: on the GPU
(``torchvision.io.decode_jpeg(list, device="cuda")``, batches of 256) and on the CPU (files read
and decoded by as many loader workers as the trainer would start, and by one process).
``--policy`` times the ``--auto_augment`` policies alone on a batch of uint8 images on the device:
torchvision's policy on one image at a time, as a loop would run it, against ``BatchPolicy``'s
ops grouped over the batch, with the same draws.
``--step_variants`` measures the bare step (world size 1) with ``torch.compile`` in each mode,
larger batches, and AdamW's foreach kernels instead of the fused ones, with the time of the first
step (compilation included).

It prints a table and writes JSON: images/s of both, efficiency = trainer / ceiling, the share of
each step spent waiting for data, in forward/backward, in the optimizer, in metrics and hooks,
and the all-reduce wait not hidden behind backward (from DDP's own timing), the time from start
to the first step, and on CUDA the achieved TFLOP/s and the fraction of the device's dense bf16
peak (FLOPs counted by ``torch.utils.flop_counter``: forward x 3 for forward and backward).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support/: what the tests and the benchmarks share

from support.harness import write_split_folder  # noqa: E402

PHONES = 100  # every 100th photo a phone camera's (12 or 24 MP): the memory bounds meet them

# Dense bf16/fp16 tensor-core peaks (FLOP/s) of common data-centre GPUs, by a fragment of
# torch.cuda.get_device_name(); the first fragment found wins, so the specific names come first.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
    "4090": 165e12,
    "3090": 71e12,
    "T4": 65e12,
}


# Variants of the bare step: torch.compile's mode, the batch's multiple, AdamW's kernels.
STEP_VARIANTS: dict[str, dict] = {
    "eager": {},
    "compile": {"compile": "default"},
    "compile_max_autotune_no_cudagraphs": {"compile": "max-autotune-no-cudagraphs"},
    "compile_reduce_overhead": {"compile": "reduce-overhead"},
    "batch_x2": {"batch_scale": 2},
    "batch_x4": {"batch_scale": 4},
    "adamw_foreach": {"adamw": "foreach"},
}
DECODE_BATCH = 256  # images per decode_jpeg call on the GPU
CLASSES = 10  # in the generated data set


# ----------------------------------------------------------------------------- orchestration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing starts")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--startup_images",
        type=int,
        default=5400,
        help="images in the generated training folder, at least (the scan of "
        "Animals-90 is part of the time to first step)",
    )
    parser.add_argument(
        "--sources",
        nargs="+",
        choices=["gpu", "ram", "none"],
        default=None,
        help="run the trainer once per --cache_images source (default: once, as the trainer "
        "flags say)",
    )
    parser.add_argument(
        "--dataset",
        choices=["auto", "patches", "photos"],
        default="auto",
        help="generated images: square noise patches of 1.25 x --image_size (quick), or "
        "photo-like JPEGs of mixed aspect, at least 500 px, one panorama (what real photos "
        "cost the caches and decoders); auto: photos when the run uses CUDA",
    )
    parser.add_argument("--decode", action="store_true", help="also measure JPEG decode rates")
    parser.add_argument(
        "--watchdog",
        action="store_true",
        help="run the trainer without and with the hang watchdog, alternating, --pairs times each",
    )
    parser.add_argument(
        "--audit",
        action="store_true",
        help="run the trainer with the data audit off and at its default rate, alternating, "
        "--pairs times each",
    )
    parser.add_argument("--pairs", "--watchdog_pairs", type=int, default=2)
    parser.add_argument(
        "--policy", action="store_true", help="also time the policies: per image vs grouped"
    )
    parser.add_argument(
        "--step_variants",
        nargs="*",
        choices=list(STEP_VARIANTS),
        default=[],
        help="also measure the bare step with these variants (world size 1)",
    )
    parser.add_argument("--output", type=Path, default=Path("bench_results/throughput.json"))
    parser.add_argument("--worker", choices=["ceiling", "trainer"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(STEP_VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args, trainer_flags = parser.parse_known_args(argv)
    args.trainer_flags = [f for f in trainer_flags if f != "--"]
    return args


def wants_photos(args: argparse.Namespace) -> bool:
    """``--dataset``: photos when asked, or (auto) when the run uses CUDA."""
    if args.dataset != "auto":
        return args.dataset == "photos"
    if args.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def run_worker(
    args: argparse.Namespace,
    mode: str,
    world_size: int,
    data: Path,
    result: Path,
    heartbeats: Path | None = None,
) -> dict:
    """One measurement as a torchrun job; with ``heartbeats``, under the hang watchdog."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        __file__,
        "--worker",
        mode,
        "--result",
        str(result),
        "--data",
        str(data),
        "--image_size",
        str(args.image_size),
        "--batch_size",
        str(args.batch_size),
        "--model",
        args.model,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--device",
        args.device,
        *(["--variant", args.variant] if getattr(args, "variant", None) else []),
        "--",
        *args.trainer_flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size))}
    watchdog = contextlib.nullcontext()
    if heartbeats is not None:
        from imgtrainer.heartbeat import HEARTBEAT_DIR_ENV
        from imgtrainer.run.watchdog import Watchdog, WatchPlan

        env[HEARTBEAT_DIR_ENV] = str(heartbeats)
        watchdog = Watchdog(WatchPlan(heartbeats, 300.0, result.parent / "logs", 0))
    with watchdog:
        completed = subprocess.run(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    if completed.returncode != 0:
        sys.exit(f"{mode} at world size {world_size} failed:\n{completed.stderr[-4000:]}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    per_run = (args.warmup + args.steps + 1) * args.batch_size * max(args.world_sizes)
    per_run *= max([1] + [STEP_VARIANTS[v].get("batch_scale", 1) for v in args.step_variants])
    report: dict = {
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("worker", "result", "data", "output")
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        photos = wants_photos(args)
        images = max(per_run, args.startup_images)  # training images, at least
        side = math.ceil(args.image_size * 1.25)
        data = write_split_folder(
            Path(tmp) / "data",
            CLASSES,
            math.ceil(images / CLASSES),
            math.ceil(max(CLASSES, images // 10) / CLASSES),  # a tenth of them for validation
            max(500, side) if photos else side,
            photos=photos,
            noise=40,
            phones=PHONES if photos else 0,
        )
        report["settings"]["dataset"] = "photos" if photos else "patches"
        print(
            f"Generated {sum(1 for _ in (data / 'train').rglob('*.jpg'))} training JPEGs "
            f"({'photos' if photos else 'patches'}) in {time.perf_counter() - started:.1f}s",
            flush=True,
        )
        report["results"] = measure_sources(args, data, Path(tmp))
        print_summary(report["results"])
        if args.watchdog:
            report["heartbeat_costs"] = heartbeat_costs(Path(tmp) / "costs")
            print_heartbeat_costs(report["heartbeat_costs"])
        if args.decode:
            report["decode"] = decode_rates(data / "train", args.device)
            print_decode(report["decode"])
        if args.policy:
            report["policy"] = policy_times(args.image_size, args.batch_size, args.device)
            print_policy(report["policy"])
        if args.step_variants:
            report["step_variants"] = measure_step_variants(args, data, Path(tmp))
            print_step_variants(report["step_variants"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"Wrote {args.output}")
    return 0


def measure_sources(args: argparse.Namespace, data: Path, tmp: Path) -> list[dict]:
    """For each world size: the ceiling once, then the trainer once per source."""
    rows = []
    for world_size in args.world_sizes:
        ceiling = run_worker(args, "ceiling", world_size, data, tmp / "ceiling.json")
        for source in args.sources or [None]:
            flags = args.trainer_flags + (["--cache_images", source] if source else [])
            run_args = argparse.Namespace(**{**vars(args), "trainer_flags": flags})
            for variant, extra in compared_variants(args):
                heartbeats = tmp / "heartbeat" if variant == "watchdog on" else None
                variant_args = {**vars(run_args), "trainer_flags": flags + extra}
                trainer = run_worker(
                    argparse.Namespace(**variant_args),
                    "trainer",
                    world_size,
                    data,
                    tmp / "trainer.json",
                    heartbeats,
                )
                rows.append(
                    {
                        "world_size": world_size,
                        "source": trainer["source"],
                        "variant": variant,
                        "ceiling": ceiling,
                        "trainer": trainer,
                        "efficiency": trainer["images_per_sec"] / ceiling["images_per_sec"],
                    }
                )
                print_row(rows[-1])
    return rows


def compared_variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, extra trainer flags) of each trainer run per source: one, or --watchdog's and
    --audit's pairs, alternating."""
    pairs: list[tuple[str, list[str]]] = []
    if args.watchdog:
        pairs += [("watchdog off", []), ("watchdog on", [])]
    if args.audit:
        pairs += [("audit off", ["--audit_data_every", "0"]), ("audit on", [])]
    return pairs * args.pairs if pairs else [("-", [])]


def measure_step_variants(args: argparse.Namespace, data: Path, tmp: Path) -> list[dict]:
    """The bare step at world size 1 for each variant, as separate processes."""
    results = []
    for variant in args.step_variants:
        run_args = argparse.Namespace(**{**vars(args), "variant": variant})
        result = run_worker(run_args, "ceiling", 1, data, tmp / f"step_{variant}.json")
        results.append({"variant": variant, **result})
        print(
            f"  step {variant:<36} {result['images_per_sec']:9.1f} img/s, first step "
            f"{result['first_step_seconds']:.1f}s",
            flush=True,
        )
    return results


def print_row(row: dict) -> None:
    c, t = row["ceiling"], row["trainer"]
    shares = "  ".join(f"{k} {v:.0%}" for k, v in t["step_shares"].items())
    variant = "" if row["variant"] == "-" else f", {row['variant']}"
    print(
        f"\nworld size {row['world_size']}, images from {row['source']}{variant}, on {t['device']} "
        f"({t['threads_per_process']} thread(s)/process, {t['loader_workers']} loader "
        "worker(s)/process)"
    )
    print(f"  ceiling  {c['images_per_sec']:8.1f} img/s   (bare loop, tensors in memory)")
    print(f"  trainer  {t['images_per_sec']:8.1f} img/s   efficiency {row['efficiency']:.3f}")
    print(f"  trainer step: {shares}")
    first = t.get("first_epoch")
    if first is not None:
        ratio = first["images_per_sec"] / c["images_per_sec"]
        first_shares = "  ".join(f"{k} {v:.0%}" for k, v in first["step_shares"].items())
        print(
            f"  first epoch (cache filling, decode check beside it): {first['images_per_sec']:.1f}"
            f" img/s, efficiency {ratio:.3f}; step: {first_shares}"
        )
    if t.get("allreduce_wait_share") is not None:
        print(
            f"  all-reduce wait not hidden by backward: {t['allreduce_wait_share']:.1%} of a "
            f"step (ceiling: {c.get('allreduce_wait_share') or 0:.1%})"
        )
    print(
        f"  time to first step {t['seconds_to_first_step']:.1f}s (of which dataset + model "
        f"set-up {t['setup_seconds']:.1f}s)"
    )
    if t.get("tflops") is not None:
        peak = t.get("fraction_of_peak")
        note = f", {peak:.1%} of the dense bf16 peak" if peak is not None else ""
        print(f"  model FLOPs: {t['tflops']:.1f} TFLOP/s per GPU{note}")


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def print_summary(rows: list[dict]) -> None:
    """One line per (world size, source): the figures the issue's table compares."""
    print(
        f"\n{'world':>5} {'source':<6} {'variant':>12} {'img/s':>9} {'ceiling':>9} "
        f"{'trainer/ceiling':>15} {'data wait':>9} {'first epoch':>11} {'of bf16 peak':>12}"
    )
    for row in rows:
        t, c = row["trainer"], row["ceiling"]
        first = t.get("first_epoch")
        first_ratio = f"{first['images_per_sec'] / c['images_per_sec']:.3f}" if first else "n/a"
        print(
            f"{row['world_size']:>5} {row['source']:<6} {row['variant']:>12} {t['images_per_sec']:>9.1f} "
            f"{c['images_per_sec']:>9.1f} {row['efficiency']:>15.3f} "
            f"{percent(t['step_shares'].get('data_wait', 0.0)):>9} {first_ratio:>11} "
            f"{percent(t.get('fraction_of_peak')):>12}"
        )


def heartbeat_costs(folder: Path, calls: int = 200_000) -> dict:
    """Microseconds per call of what the hang watchdog adds to a rank: a phase mark, 3 per step
    and 2 per host collective."""
    import os as _os

    from imgtrainer import heartbeat

    _os.environ[heartbeat.HEARTBEAT_DIR_ENV] = str(folder)
    try:
        slot = heartbeat.open_slot(0, 0)
        heartbeat.start(0)
        started = time.perf_counter()
        for _ in range(calls):
            heartbeat.mark(heartbeat.Phase.STEP)
        costs = {"mark": (time.perf_counter() - started) / calls * 1e6}
        slot.close()
    finally:
        del _os.environ[heartbeat.HEARTBEAT_DIR_ENV]
        heartbeat._slot.clear()
    return costs


def print_heartbeat_costs(costs: dict) -> None:
    print(
        f"\nhang watchdog per call: phase mark {costs['mark']:.2f} us (3 per step, 2 per host "
        "collective)"
    )


def print_decode(rates: dict) -> None:
    print(f"\nJPEG decode ({rates['images']} files of {rates['mean_kib']:.0f} KiB on average)")
    for name, figures in rates["rates"].items():
        print(f"  {name:<36} {figures['images_per_sec']:9.1f} img/s")


def print_step_variants(results: list[dict]) -> None:
    base = next((r for r in results if r["variant"] == "eager"), None)
    print(
        f"\n{'step variant (world size 1)':<36} {'batch':>5} {'img/s':>9} {'vs eager':>8} "
        f"{'first step':>10} {'of bf16 peak':>12}"
    )
    for r in results:
        ratio = f"{r['images_per_sec'] / base['images_per_sec']:.2f}" if base else "n/a"
        print(
            f"{r['variant']:<36} {r['batch_size']:>5} {r['images_per_sec']:>9.1f} {ratio:>8} "
            f"{r['first_step_seconds']:>9.1f}s {percent(r.get('fraction_of_peak')):>12}"
        )


# ----------------------------------------------------------------------------- workers


def worker_main(args: argparse.Namespace) -> int:
    """One measurement inside torchrun; rank 0 writes the result file."""
    from imgtrainer.config import parse_config
    from imgtrainer.distributed.setup import cleanup_distributed, setup_distributed

    cfg = parse_config(
        [
            "--train_dir",
            str(args.data / "train"),
            "--val_dir",
            str(args.data / "val"),
            "--image_size",
            str(args.image_size),
            "--batch_size",
            str(args.batch_size),
            "--model",
            args.model,
            "--device",
            args.device,
            "--epochs",
            "1",
            "--log_dir",
            str(args.result.parent / "logs"),
            "--checkpoint_dir",
            str(args.result.parent / "checkpoints"),
            "--no_tensorboard",
            *args.trainer_flags,
        ]
    )
    from imgtrainer.precision import configure_backends

    dist = setup_distributed(cfg.device)
    try:
        # The trainer's kernel choices (cudnn.benchmark, determinism) for both measurements.
        configure_backends(dist.device, cfg.deterministic)
        if args.worker == "ceiling":
            variant = STEP_VARIANTS[args.variant] if args.variant else {}
            result = measure_ceiling(cfg, dist, args.warmup, args.steps, variant)
        else:
            result = measure_trainer(cfg, dist, args.warmup, args.steps)
        result.update(
            device=dist.device.type,
            world_size=dist.world_size,
            threads_per_process=__import__("torch").get_num_threads(),
        )
        if dist.is_main:
            args.result.write_text(json.dumps(result))
    finally:
        cleanup_distributed()
    return 0


def measure_ceiling(cfg, dist, warmup: int, steps: int, variant: dict | None = None) -> dict:
    """The bare step on tensors already on the device; ``variant`` (one of STEP_VARIANTS)
    compiles the model in a mode, scales the batch, or swaps AdamW's kernels."""
    import torch

    from imgtrainer.training.build import build_run_parts

    variant = variant or {}
    # The trainer's own parts (model, savers, wrappers, optimizer, precision, scaler, loss).
    parts = build_run_parts(cfg, dist, num_classes=10, steps_per_epoch=1)
    model, optimizer, scaler = parts.model, parts.optimizer, parts.scaler
    precision, criterion = parts.precision, parts.criterion
    if variant.get("compile"):
        model = torch.compile(
            model, mode=None if variant["compile"] == "default" else variant["compile"]
        )
    if variant.get("adamw") == "foreach":
        if cfg.optimizer != "adamw":
            raise SystemExit("the adamw_foreach variant needs --optimizer adamw")
        groups = [{**g, "fused": None, "foreach": True} for g in optimizer.param_groups]
        optimizer = torch.optim.AdamW(groups)
    batch_size = cfg.batch_size * variant.get("batch_scale", 1)
    channels_last = cfg.channels_last and dist.device.type == "cuda"  # as the trainer does
    images = torch.randn(batch_size, 3, cfg.image_size, cfg.image_size, device=dist.device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    targets = torch.randint(0, 10, (batch_size,), device=dist.device)
    model.train()
    first_started = time.perf_counter()
    for step in range(warmup + steps):
        if step == 1:
            synchronize(dist.device)
            first_step = time.perf_counter() - first_started
        if step == warmup:
            synchronize(dist.device)
            started = time.perf_counter()
        with precision.autocast(dist.device):
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    synchronize(dist.device)
    seconds = time.perf_counter() - started
    result = {
        "images_per_sec": steps * batch_size * dist.world_size / seconds,
        "step_seconds": seconds / steps,
        "batch_size": batch_size,
        "first_step_seconds": first_step,
        "optimizer_kernels": sorted(
            {k for g in optimizer.param_groups for k in ("fused", "foreach") if g.get(k)}
        ),
        "allreduce_wait_share": allreduce_wait_share(model, seconds / steps),
    }
    if dist.device.type == "cuda":
        per_gpu = result["images_per_sec"] / dist.world_size
        result.update(model_flops(parts.plain_model, dist.device, cfg.image_size, per_gpu))
    return result


def measure_trainer(cfg, dist, warmup: int, steps: int) -> dict:
    """The trainer's steady state (its second epoch: the RAM cache filled, the decode check
    finished) at the top level, and its first epoch's figures (the cache filling, the decode
    check running beside it) under ``first_epoch``: both timed over ``steps`` steps after
    ``warmup``, the first epoch then run to its end."""
    import torch

    from imgtrainer.training.assemble import assemble
    from imgtrainer.training.trainer import Trainer

    setup_started = time.perf_counter()
    trainer = Trainer(assemble(cfg, dist))
    trainer.register_hooks()  # the run's own per-step work (TensorBoard is off: see worker_main)
    setup_seconds = time.perf_counter() - setup_started
    from imgtrainer import heartbeat

    # Under --watchdog: this rank's heartbeat slot, as the trainer opens it (``run.train.watched``)
    if heartbeat.open_slot(dist.rank, 0) is not None:
        heartbeat.start(0)
    cpu = dist.device.type == "cpu"
    first = run_trainer_steps(trainer, warmup, steps, PhaseTimer(enabled=cpu), epoch=0)
    audited = trainer.train_loader.audit_results()[0]  # the data audit's images, both epochs
    trainer.loaders.check.finish()  # as the trainer does at the first epoch's end
    # On CUDA the per-phase synchronisation would slow the step down: time the throughput
    # without it, then take the breakdown from a second, separately timed pass.
    timed = run_trainer_steps(trainer, warmup, steps, PhaseTimer(enabled=cpu), epoch=1)
    if dist.device.type == "cuda":
        timed["timer"] = run_trainer_steps(
            trainer, 1, steps, PhaseTimer(enabled=True, synchronize=torch.cuda.synchronize), 2
        )["timer"]
    result = {
        **step_figures(timed, steps, cfg.batch_size * dist.world_size),
        "allreduce_wait_share": allreduce_wait_share(trainer.parts.model, timed["seconds"] / steps),
        "seconds_to_first_step": setup_seconds + first["first_step_seconds"],
        "setup_seconds": setup_seconds,
        "loader_workers": trainer.train_loader.num_workers,
        "train_images": len(trainer.train_loader.dataset),
        "source": str(trainer.train_loader.dataset.source),
        "first_epoch": step_figures(first, steps, cfg.batch_size * dist.world_size),
        "audit": audit_figures(trainer, audited + trainer.train_loader.audit_results()[0]),
    }
    if dist.device.type == "cuda":
        per_gpu = result["images_per_sec"] / dist.world_size
        result.update(model_flops(trainer.parts.plain_model, dist.device, cfg.image_size, per_gpu))
        # Allocations the caching allocator retried after freeing its cached blocks (a device
        # sync each): the copy, decode and compute streams' pools near the limit.
        result["alloc_retries"] = torch.cuda.memory_stats(dist.device).get("num_alloc_retries", 0)
    return result


def audit_figures(trainer, audited: list) -> dict:
    """The data audit's images checked against the CPU reference, the largest difference
    (0-255 levels) and its source's tolerance."""
    audit = trainer.train_loader.audit
    return {
        "images": len(audited),
        "max_diff": max((a.difference for a in audited), default=None),
        "tolerance": None if audit is None else audit.tolerance,
    }


def step_figures(timed: dict, steps: int, images_per_step: int) -> dict:
    """Images/s, seconds per step and each phase's share of a step, of a timed stretch."""
    phases = dict(timed["timer"].seconds)
    step_total = sum(phases.values()) or 1.0
    return {
        "images_per_sec": steps * images_per_step / timed["seconds"],
        "step_seconds": timed["seconds"] / steps,
        "step_shares": {k: v / step_total for k, v in phases.items()},
    }


def run_trainer_steps(trainer, warmup: int, steps: int, timer: PhaseTimer, epoch: int = 0) -> dict:
    """Run the real ``train_one_epoch`` of ``epoch``, timing ``steps`` optimizer steps after
    ``warmup``; the first epoch runs to its end (its images all read once: cached, checked),
    the others stop after the timed steps."""
    from imgtrainer.hooks import Hook
    from imgtrainer.training.loop import EpochPlan, ProgressBar, train_one_epoch

    clock: dict = {"start": time.perf_counter()}

    class Clock(Hook):
        """The last hook: closes the metrics-and-hooks phase, times the steps and ends the
        epoch early."""

        def on_step_end(self, info) -> bool:
            timer.end("metrics_and_hooks")
            if info.step == 1:
                clock["first_step"] = time.perf_counter() - clock["start"]
            if info.step == warmup:
                synchronize(trainer.dist.device)
                timer.seconds.clear()
                clock["timed_from"] = time.perf_counter()
            if info.step == warmup + steps:
                synchronize(trainer.dist.device)
                clock["seconds"] = time.perf_counter() - clock["timed_from"]
                timer.enabled, clock["phases"] = False, dict(timer.seconds)
                return epoch > 0
            return False

    mixer = (
        trainer.loaders.mixer.for_epoch(epoch) if trainer.loaders.mixer else None
    )  # --mixup/--cutmix
    trainer.loaders.sampler.set_epoch(epoch)
    with timer.attached():
        train_one_epoch(
            trainer.parts,
            timer.loader(trainer.train_loader),
            hooks=[*trainer.hooks, Clock()],
            progress=ProgressBar(trainer.dist.is_main),
            epoch=EpochPlan(
                log_interval=trainer.cfg.log_interval,
                mixer=timer.mixer(mixer) if mixer else None,
            ),
        )
    synchronize(trainer.dist.device)
    timer.seconds = defaultdict(float, clock["phases"])
    return {
        "seconds": clock["seconds"],
        "timer": timer,
        "first_step_seconds": clock["first_step"],
    }


class PhaseTimer:
    """Wall time in each phase of the training step, measured from outside the training code:
    the loader, the mixer and the step functions the loop calls are wrapped while ``attached``.

    Phases: data_wait (the next batch), mixing, forward_backward (``accumulate_gradients``),
    optimizer (the rest of ``train_step``), metrics_and_hooks (from the step's end to the end of
    the last hook: scheduler, logging-step metrics, hooks). On CUDA, pass
    ``synchronize=torch.cuda.synchronize`` so each phase's kernels are counted in that phase;
    that removes the overlap between phases, so time whole runs without the timer.
    """

    def __init__(self, enabled: bool = False, synchronize=None):
        self.enabled = enabled
        self.synchronize = synchronize or (lambda: None)
        self.seconds: dict[str, float] = defaultdict(float)
        self.started: dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            self.synchronize()
            self.started[name] = time.perf_counter()

    def end(self, name: str) -> float:
        """Add the time since ``start(name)`` to the phase; returns it (0 if not started)."""
        if not self.enabled or name not in self.started:
            return 0.0
        self.synchronize()
        elapsed = time.perf_counter() - self.started.pop(name)
        self.seconds[name] += elapsed
        return elapsed

    def timed(self, name: str, function):
        def wrapper(*args, **kwargs):
            self.start(name)
            try:
                return function(*args, **kwargs)
            finally:
                self.end(name)

        return wrapper

    def loader(self, loader):
        timer = self

        class TimedLoader:
            def __len__(self) -> int:
                return len(loader)

            def __iter__(self):
                iterator = iter(loader)
                while True:
                    timer.start("data_wait")
                    batch = next(iterator, None)
                    timer.end("data_wait")
                    if batch is None:
                        return
                    yield batch

        return TimedLoader()

    def mixer(self, mixer):
        return self.timed("mixing", mixer)

    @contextlib.contextmanager
    def attached(self):
        """Wrap the step functions the loop calls (restored on exit)."""
        from imgtrainer.training import loop, step

        accumulate, train_step = step.accumulate_gradients, loop.train_step

        def timed_train_step(*args, **kwargs):
            self.start("step")
            forward_backward = self.seconds["forward_backward"]
            result = train_step(*args, **kwargs)
            elapsed = self.end("step")
            self.seconds.pop("step", None)
            if self.enabled:
                self.seconds["optimizer"] += elapsed - (
                    self.seconds["forward_backward"] - forward_backward
                )
            self.start("metrics_and_hooks")
            return result

        step.accumulate_gradients = self.timed("forward_backward", accumulate)
        loop.train_step = timed_train_step
        try:
            yield self
        finally:
            step.accumulate_gradients, loop.train_step = accumulate, train_step


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allreduce_wait_share(model, step_seconds: float) -> float | None:
    """The all-reduce time not overlapped with backward, from DDP's own sampled timings."""
    from torch.nn.parallel import DistributedDataParallel

    from imgtrainer import torch_compat

    ddp = torch_compat.compiled_original(model)
    if not isinstance(ddp, DistributedDataParallel):
        return None
    try:
        stats = torch_compat.ddp_logging_data(ddp)
        exposed_ns = (
            stats["avg_backward_comm_time"] - stats["avg_backward_compute_comm_overlap_time"]
        )
    except (AttributeError, KeyError, RuntimeError):
        return None
    return max(0.0, exposed_ns / 1e9) / step_seconds


def model_flops(model, device, image_size: int, images_per_sec_per_gpu: float) -> dict:
    """Achieved training FLOP/s per GPU (forward FLOPs x 3, counted by torch's FlopCounterMode)
    and its fraction of the device's dense bf16 peak."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    images = torch.randn(2, 3, image_size, image_size, device=device)
    was_training = model.training
    model.eval()  # the count is the same; BatchNorm's running statistics stay as they are
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(images)
    model.train(was_training)
    per_image = 3 * counter.get_total_flops() / 2
    achieved = per_image * images_per_sec_per_gpu
    name = torch.cuda.get_device_name(device)
    peak = next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
    return {
        "tflops": achieved / 1e12,
        "gflops_per_image": per_image / 1e9,
        "gpu": name,
        "fraction_of_peak": achieved / peak if peak else None,
    }


# ----------------------------------------------------------------------------- JPEG decoding


class JpegFiles:
    """Each file's bytes decoded to a uint8 tensor (3, H, W): what a loader worker does with a
    JPEG file, resizing and cropping aside."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        from torchvision.io import ImageReadMode, decode_jpeg, read_file

        return decode_jpeg(read_file(str(self.paths[index])), mode=ImageReadMode.RGB)


def decode_rates(folder: Path, device: str, limit: int = 4096) -> dict:
    """Images/s of JPEG decoding: one CPU process (bytes in memory), the loader workers the
    trainer would start (reading the files), and on CUDA batched nvJPEG decoding."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    from imgtrainer.data.loaders import loader_workers
    from imgtrainer.distributed.setup import cpu_cores_available

    paths = sorted(folder.rglob("*.jpg"))[:limit]
    encoded = [read_file(str(path)) for path in paths]
    use_cuda = device != "cpu" and torch.cuda.is_available()
    rates: dict[str, dict] = {}

    started = time.perf_counter()
    few = encoded[: max(1, len(encoded) // 4)]
    for data in few:
        decode_jpeg(data, mode=ImageReadMode.RGB)
    rates["cpu, 1 process"] = {"images_per_sec": len(few) / (time.perf_counter() - started)}

    workers = loader_workers(None, cpu_cores_available(), "cuda" if use_cuda else "cpu", "files")
    loader = DataLoader(JpegFiles(paths), batch_size=64, num_workers=workers, collate_fn=list)
    started = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    rates[f"cpu, {workers} loader worker(s), from files"] = {
        "images_per_sec": count / (time.perf_counter() - started),
        "workers": workers,
    }
    if use_cuda:
        decode_jpeg(encoded[:DECODE_BATCH], mode=ImageReadMode.RGB, device="cuda")  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(0, len(encoded), DECODE_BATCH):
            decode_jpeg(encoded[i : i + DECODE_BATCH], mode=ImageReadMode.RGB, device="cuda")
        torch.cuda.synchronize()
        rates[f"cuda, nvJPEG, batches of {DECODE_BATCH}"] = {
            "images_per_sec": len(encoded) / (time.perf_counter() - started)
        }
    mean_kib = sum(e.numel() for e in encoded) / max(1, len(encoded)) / 1024
    return {"images": len(encoded), "mean_kib": mean_kib, "rates": rates}


# ----------------------------------------------------------------------------- policies


def policy_times(image_size: int, batch_size: int, device: str, repeats: int = 5) -> dict:
    """ms per batch (the median of ``repeats``, after a warm-up) of each ``--auto_augment``
    policy on random uint8 images on the device: torchvision's policy image by image, each under
    its own seed, against ``BatchPolicy`` on the whole batch drawing the same ops (the host's
    part included)."""
    import torch

    from imgtrainer.data.device.policy import BatchPolicy
    from imgtrainer.data.host.draws import draw_policy
    from imgtrainer.data.host.samples import seeded_cpu_generator

    on = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(0)
    shape = (batch_size, 3, image_size, image_size)
    images = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(on)

    def median_ms(function) -> float:
        times = []
        for _ in range(repeats + 1):
            synchronize(on)
            started = time.perf_counter()
            function()
            synchronize(on)
            times.append((time.perf_counter() - started) * 1000)
        return sorted(times[1:])[repeats // 2]

    policies: dict[str, dict] = {}
    for name in ("trivialaugment", "randaugment"):
        grouped = BatchPolicy(name, image_size)
        rows = []
        for n in range(batch_size):  # the ops torchvision's policy draws under seed n below
            with seeded_cpu_generator(n):
                rows.append(draw_policy(name))
        choices = torch.tensor(rows)

        def per_image(transform=grouped.transform):
            out = images.clone()
            for n in range(batch_size):
                with seeded_cpu_generator(n):
                    out[n] = transform(out[n])

        per_image_ms = median_ms(per_image)
        grouped_ms = median_ms(lambda g=grouped, c=choices: g(images.clone(), c))
        policies[name] = {"per_image_ms": per_image_ms, "grouped_ms": grouped_ms}
    return {"device": on.type, "image_size": image_size, "batch_size": batch_size, **policies}


def print_policy(times: dict) -> None:
    print(
        f"\n--auto_augment on a batch of {times['batch_size']} at {times['image_size']} px "
        f"({times['device']}), ms per batch"
    )
    for name in ("trivialaugment", "randaugment"):
        t = times[name]
        speedup = t["per_image_ms"] / t["grouped_ms"]
        print(
            f"  {name:<15} per image {t['per_image_ms']:8.1f}   grouped {t['grouped_ms']:8.1f}"
            f"   x{speedup:.1f}"
        )


if __name__ == "__main__":
    code = main()
    if "--worker" in sys.argv:
        # The trainer's loader workers leave stopping to it (they ignore SIGTERM), and an epoch
        # cut short leaves them running: multiprocessing's exit handler would wait for them
        # forever. The result is written; end the measurement process here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

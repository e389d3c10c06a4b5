#!/usr/bin/env python
"""GPU measurements on photo-like JPEGs: one table of measured rows, and a JSON file.

    python bench/gpu_check.py                          # the default rows; table + JSON
    python bench/gpu_check.py --only jpeg_decode       # some rows only
    python bench/gpu_check.py --only step_variants --seconds 570   # torch.compile modes etc.
    python bench/gpu_check.py --work_dir /tmp/gc       # keep every run's logs and checkpoints

Whether each CUDA path works is not measured here but tested: ``python -m pytest -m cuda
tests/`` (tests/gpu/ runs every path through the real launcher). The rows, each alone, on
5,400 photos of mixed aspect (short side 500 px or more, 16:9 both ways, one 4:1 panorama, every
100th a phone's 12 or 24 MP; tests/support/harness.py's ``write_split_folder``, written once):

  * low_memory_224: ``--low_memory --max_memory_gb 2 --batch_size 64`` at 224 px against the
    same run without it, 2 epochs each: peak allocated memory against the budget, images/s of
    epoch 2 against the 0.7 target;
  * throughput_224_cache_{gpu,ram,none,auto}: bench/throughput.py's trainer at 224 px, batch
    256, bfloat16, channels_last, per --cache_images (auto: the source it chose) against the
    bare loop's ceiling: images/s, TFLOP/s and the share of the device's dense bf16 peak,
    trainer/ceiling efficiency, the data-wait share, loader workers, time to the first step;
  * jpeg_decode: batched nvJPEG against the loader workers the trainer would start;
  * step_variants (only when named: compiling takes minutes): the bare step eager and with
    each of bench/throughput.py's STEP_VARIANTS, relative to eager, with the first step's time.

Each row is measured against its targets where it has some and says pass or FAIL: the trainer's
efficiency by source (0.9 GPU cache, 0.8 RAM, 0.5 JPEG files) and the bare step's share of the
bf16 peak (15%); the data audit's largest difference per source within its tolerance
(data_audit, from the throughput rows' trainers); no host synchronisation between logging steps
in the training thread (sync_audit, a tiny run per source). A row that fails, or cannot be
measured (its run failed: the error is listed, the others still run), makes the exit code 1.
Without CUDA it prints one line and exits 0. The versions it ran on head the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support/: what the tests and the benchmarks share

import throughput  # noqa: E402  (bench/throughput.py, beside this script)

from support.folder_runs import RUN_SECONDS, expect_finished, launch  # noqa: E402
from support.harness import write_split_folder  # noqa: E402

TOTAL_SECONDS = 420.0  # rows not started by then are skipped
LOW_MEMORY_BUDGET_GB = 2.0
PHOTOS = (10, 540, 54, 500)  # classes, training and validation photos per class, short side
THROUGHPUT_FLAGS = ["--image_size", "224", "--batch_size", "256", "--warmup", "5", "--steps", "15"]
THROUGHPUT_FLAGS += ["--world_sizes", "1", "--device", "cuda", "--", "--use_amp"]
# The data audit at its default rate (every 100th batch and the first 3), as users train.
THROUGHPUT_FLAGS += ["--amp_dtype", "bfloat16"]
# The targets a throughput row passes: trainer/ceiling by image source (the project's goals:
# the GPU cache near the bare step, RAM close, JPEG files decoded by the loader workers at half).
EFFICIENCY_TARGETS = {"gpu": 0.9, "ram": 0.8, "nvjpeg": 0.5, "files": 0.5}
# The bare step's goal, in images/s: 15% of the dense bf16 matmul rate measured on H100-class
# GPUs (about 800 TFLOP/s of their 989 peak), at the step's FLOPs per image (10.9 GFLOP for
# ResNet18 at 224 px): 11,000 img/s there; scaled by each device's listed peak elsewhere.
PEAK_TARGET, MEASURED_OF_PEAK = 0.15, 800 / 989
# The step variants, most informative first: a run out of time skips the last ones.
STEP_VARIANTS = (
    "eager",
    "adamw_foreach",
    "batch_x2",
    "batch_x4",
    "compile",
    "compile_reduce_overhead",
    "compile_max_autotune_no_cudagraphs",
)


@dataclass
class Bench:
    """What every row may use: a work folder, the device's name, the photos, the deadline."""

    work: Path
    gpu_name: str
    deadline: float
    data: Path | None = None
    ceiling: dict[str, Any] | None = None  # the bare loop, measured once for the cache modes
    audits: dict[str, Any] = field(default_factory=dict)  # the data audit, by image source

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def photos(self) -> Path:
        if self.data is None:
            self.data = write_split_folder(
                self.work / "photos", *PHOTOS, photos=True, phones=throughput.PHONES
            )
        return self.data

    def launch(self, name: str, flags: Sequence[str]):
        timeout = max(1.0, min(RUN_SECONDS, self.seconds_left()))
        return launch(self.work / name, self.photos(), flags, timeout=timeout)


def low_memory(bench: Bench) -> dict[str, Any]:
    flags = ["--image_size", "224", "--batch_size", "64", "--epochs", "2", "--cache_images", "ram"]
    normal = expect_finished(bench.launch("low_memory_off", flags), 2)
    budget = ["--low_memory", "--max_memory_gb", str(LOW_MEMORY_BUDGET_GB)]
    run = bench.launch("low_memory_on", [*flags, *budget])
    low = expect_finished(run, 2)
    return low_memory_figures(normal, low, run.history()["epochs"][-1]["micro_batch"])


def low_memory_figures(normal: dict, low: dict, micro_batch: int) -> dict[str, Any]:
    """The low-memory row from its two runs: the peak against the budget, the speed ratio."""
    ratio = low["img/s"] / normal["img/s"]
    return {
        "peak MiB": low["peak MiB"],
        f"budget {LOW_MEMORY_BUDGET_GB:g} GiB": verdict(
            low["peak MiB"] <= LOW_MEMORY_BUDGET_GB * 1024
        ),
        "normal peak MiB": normal["peak MiB"],
        "img/s": low["img/s"],
        "normal img/s": normal["img/s"],
        "speed ratio": ratio,
        "speed target 0.7": verdict(ratio >= 0.7),
        "micro-batch": micro_batch,
    }


def peak_share(result: dict[str, Any]) -> Any:
    return result.get("fraction_of_peak") or "unknown device peak"


def trainer_throughput(cache: str) -> Callable[[Bench], dict[str, Any]]:
    """bench/throughput.py's trainer for one --cache_images against the ceiling, and against
    its targets (``throughput_figures``)."""

    def measure(bench: Bench) -> dict[str, Any]:
        args = throughput.parse_args([*THROUGHPUT_FLAGS, "--cache_images", cache])
        folder = bench.work / f"throughput_{cache}"
        folder.mkdir()
        if bench.ceiling is None:
            bench.ceiling = run_worker(args, "ceiling", bench.photos(), folder)
        trainer = run_worker(args, "trainer", bench.photos(), folder)
        bench.audits[trainer["source"]] = trainer["audit"]
        return throughput_figures(trainer, bench.ceiling)

    return measure


def ceiling_target(ceiling: dict[str, Any]) -> float | None:
    """The bare step's goal in images/s (``PEAK_TARGET``); None for a device of unknown peak."""
    share, tflops = ceiling.get("fraction_of_peak"), ceiling.get("tflops")
    if not share or not tflops:
        return None
    peak = tflops * 1e12 / share
    return PEAK_TARGET * MEASURED_OF_PEAK * peak / (ceiling["gflops_per_image"] * 1e9)


def throughput_figures(trainer: dict[str, Any], ceiling: dict[str, Any]) -> dict[str, Any]:
    """A throughput row: the trainer's images/s against the ceiling's (its source's
    EFFICIENCY_TARGETS) and the ceiling against its goal in images/s (``ceiling_target``)."""
    efficiency = trainer["images_per_sec"] / ceiling["images_per_sec"]
    target = EFFICIENCY_TARGETS[trainer["source"]]
    goal = ceiling_target(ceiling)
    first = trainer["first_epoch"]
    return {
        "img/s": trainer["images_per_sec"],
        "TFLOP/s": trainer.get("tflops"),
        "of bf16 peak": peak_share(trainer),
        "ceiling img/s": ceiling["images_per_sec"],
        "ceiling of bf16 peak": peak_share(ceiling),
        "efficiency": efficiency,
        "first epoch efficiency": first["images_per_sec"] / ceiling["images_per_sec"],
        "data wait": trainer["step_shares"].get("data_wait", 0.0),
        "loader workers": trainer["loader_workers"],
        "source": trainer["source"],
        "first step s": trainer["seconds_to_first_step"],
        "alloc retries": trainer.get("alloc_retries", "n/a"),
        f"efficiency target {target:g}": verdict(efficiency >= target),
        "ceiling target": "unknown peak" if goal is None else f"{goal:.0f} img/s",
        "ceiling": "unknown peak" if goal is None else verdict(ceiling["images_per_sec"] >= goal),
    }


def data_audit(bench: Bench) -> dict[str, Any]:
    """The data audit of the throughput rows' trainers (at its default rate), one line per
    source: the images checked against the CPU reference, the largest difference (0-255
    levels) and the source's tolerance."""
    if not bench.audits:
        raise RuntimeError("no throughput row ran: nothing was audited")
    return audit_figures(bench.audits)


def audit_figures(audits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for source, audit in audits.items():
        figures[f"{source} images"] = audit["images"]
        figures[f"{source} max diff"] = audit["max_diff"]
        passed = audit["images"] > 0 and audit["max_diff"] <= audit["tolerance"]
        figures[f"{source} within {audit['tolerance']:g}"] = verdict(passed)
    return figures


def sync_audit(bench: Bench) -> dict[str, Any]:
    """Host synchronisations in the training thread's steps between logging steps (target 0),
    per source, bfloat16 with the EMA, on a tiny run (tests/support/sync_audit.py)."""
    from support.harness import write_image_folder
    from support.sync_audit import audit_run

    root = bench.work / "sync_audit"
    train = write_image_folder(root / "train", ["a", "b"], 21, size=24, seed=1)
    val = write_image_folder(root / "val", ["a", "b"], 4, size=24, seed=2)
    found = {}
    for source in ("gpu", "ram", "none"):
        result = audit_run(train, val, source, batch=4, precision="bf16", device="cuda")
        found[source] = len(result.unexpected_syncs()) + len(result.unexpected_cuda_warnings())
    return sync_figures(found)


def sync_figures(found: dict[str, int]) -> dict[str, Any]:
    """The synchronisations counted per source, each against the target 0."""
    figures: dict[str, Any] = {}
    for source, count in found.items():
        figures[f"{source} syncs"] = count
        figures[f"{source} target 0"] = verdict(count == 0)
    return figures


def verdict(passed: bool) -> str:
    return "pass" if passed else "FAIL"


def jpeg_decode(bench: Bench) -> dict[str, Any]:
    rates = throughput.decode_rates(bench.photos() / "train", "cuda")
    figures = {name: r["images_per_sec"] for name, r in rates["rates"].items()}
    if not any(name.startswith("cuda") for name in figures):
        raise RuntimeError(f"no GPU decoding was measured: {figures}")
    return figures


def step_variants(bench: Bench) -> dict[str, Any]:
    """The bare step with each variant, images/s against eager, the first step's seconds."""
    args = throughput.parse_args(THROUGHPUT_FLAGS)
    folder = bench.work / "step_variants"
    folder.mkdir()
    figures: dict[str, Any] = {}
    eager = None
    for variant in STEP_VARIANTS:
        if bench.seconds_left() < 150:
            figures[variant] = "skipped: out of time"
            continue
        run_args = argparse.Namespace(**{**vars(args), "variant": variant})
        result = run_worker(run_args, "ceiling", bench.photos(), folder)
        eager = eager or result["images_per_sec"]
        figures[f"{variant} img/s"] = result["images_per_sec"]
        figures[f"{variant} vs eager"] = result["images_per_sec"] / eager
        figures[f"{variant} first step s"] = result["first_step_seconds"]
    return figures


def run_worker(args: argparse.Namespace, mode: str, data: Path, folder: Path) -> dict[str, Any]:
    name = f"{mode}_{args.variant}" if getattr(args, "variant", None) else mode
    try:
        return throughput.run_worker(args, mode, 1, data, folder / f"{name}.json")
    except SystemExit as err:  # run_worker exits with the worker's stderr on failure
        raise RuntimeError(f"bench/throughput.py {mode}: {str(err.code)[-600:]}") from None


ROWS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "low_memory_224": low_memory,
    **{f"throughput_224_cache_{c}": trainer_throughput(c) for c in ("gpu", "ram", "none", "auto")},
    "data_audit": data_audit,
    "sync_audit": sync_audit,
    "jpeg_decode": jpeg_decode,
    "step_variants": step_variants,
}
ON_REQUEST = {"step_variants"}  # too long for the default run


def measure(name: str, bench: Bench) -> dict[str, Any]:
    """One row: its figures, or why it has none (a failed run, or no time left)."""
    started = time.monotonic()
    row: dict[str, Any] = {"row": name, "status": "ok", "figures": {}, "detail": ""}
    if bench.seconds_left() < 20:
        row.update(status="skip", detail="out of time")
    else:
        try:
            row["figures"] = ROWS[name](bench)
            row["status"] = row_status(row["figures"])
        except Exception as err:  # noqa: BLE001 - a row that fails is reported, the rest measured
            detail = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
            row.update(status="error", detail=detail)
    row["seconds"] = time.monotonic() - started
    print(f"  {row['status']:<5} {name} ({row['seconds']:.0f}s) {format_figures(row['figures'])}")
    if row["detail"]:
        print(f"        -> {row['detail'].splitlines()[0][:300]}", flush=True)
    return row


def row_status(figures: dict[str, Any]) -> str:
    """FAIL if a target is missed, pass if every target is met, ok for figures only."""
    verdicts = [v for v in figures.values() if v in ("pass", "FAIL")]
    return ("FAIL" if "FAIL" in verdicts else "pass") if verdicts else "ok"


def exit_code(rows: Sequence[dict[str, Any]]) -> int:
    """1 when a row missed a target, could not be measured or was skipped past the deadline
    (its targets unchecked); else 0."""
    return 1 if any(r["status"] in ("FAIL", "error", "skip") for r in rows) else 0


def format_figures(figures: dict[str, Any]) -> str:
    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    return ", ".join(f"{key} {fmt(value)}" for key, value in figures.items())


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """row | status | seconds | figures, and under a row without figures why."""
    width = max([len("row")] + [len(r["row"]) for r in rows])
    lines = [f"{'row':<{width}}  {'status':<6}  {'time':>6}  figures"]
    lines.append(f"{'-' * width}  {'-' * 6}  {'-' * 6}  {'-' * 40}")
    for r in rows:
        figures = format_figures(r["figures"])
        lines.append(f"{r['row']:<{width}}  {r['status']:<6}  {r['seconds']:>5.0f}s  {figures}")
        if r["detail"]:
            lines.append(f"{'':<{width}}  -> {r['detail'].splitlines()[0][:200]}")
    return "\n".join(lines)


def versions() -> dict[str, str]:
    """What the rows ran on: Python, torch, torchvision, timm, CUDA, cuDNN, the allocator."""
    import timm
    import torch
    import torchvision

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "timm": timm.__version__,
        "cuda": str(torch.version.cuda),
        "cudnn": str(torch.backends.cudnn.version()),
        "allocator": torch.cuda.get_allocator_backend(),
    }


# ----------------------------------------------------------------------------- the self-test

# A healthy H200's figures (the H100's of NOTES.md, with room): every target met.
CEILING = {"images_per_sec": 12006.0, "tflops": 130.9, "fraction_of_peak": 0.1324}
CEILING["gflops_per_image"] = 10.9
TRAINERS = {"gpu": 11500.0, "ram": 10000.0, "nvjpeg": 7000.0}


def trainer_result(source: str, images_per_sec: float) -> dict[str, Any]:
    return {
        "images_per_sec": images_per_sec,
        "source": source,
        "first_epoch": {"images_per_sec": images_per_sec},
        "step_shares": {"data_wait": 0.05},
        "loader_workers": 15,
        "seconds_to_first_step": 9.0,
    }


def planted(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    return {"row": name, "status": row_status(figures), "figures": figures, "detail": ""}


def planted_rows(**faults: Any) -> list[dict[str, Any]]:
    """The default rows from planted figures, each passed through its row's verdict code;
    ``faults`` changes one measurement (or, ``skipped``, lets the deadline pass first)."""
    trainers = {**TRAINERS, **faults.get("trainers", {})}
    rows = [
        planted(
            "low_memory_224",
            low_memory_figures(
                {"peak MiB": 4086.0, "img/s": 1472.0},
                {"peak MiB": faults.get("low_peak", 783.0), "img/s": 1100.0},
                64,
            ),
        ),
        *(
            planted(
                f"throughput_224_{source}",
                throughput_figures(
                    trainer_result(source, rate), {**CEILING, **faults.get("ceiling", {})}
                ),
            )
            for source, rate in trainers.items()
        ),
        planted(
            "data_audit",
            audit_figures(
                {
                    s: {"images": 3, "max_diff": faults.get("audit_diff", 1.2), "tolerance": 3.0}
                    for s in ("gpu", "ram")
                }
            ),
        ),  # fmt: skip
        planted("sync_audit", sync_figures({"gpu": 0, "ram": 0, "none": faults.get("syncs", 0)})),
    ]
    if faults.get("skipped"):
        with tempfile.TemporaryDirectory() as tmp:
            late = Bench(Path(tmp), "planted", deadline=time.monotonic() - 1)
            rows.append(measure("jpeg_decode", late))
    return rows


SELF_TEST_CASES = {
    "every target met": ({}, 0),
    "a trainer's efficiency under its target (ram 0.67 of 0.8)": ({"trainers": {"ram": 8000.0}}, 1),
    "the bare step under its goal (9,000 of 11,009 img/s)": ({"ceiling": {"images_per_sec": 9000.0, "tflops": 98.1, "fraction_of_peak": 0.0992}}, 1),
    "the low-memory budget missed (2,300 MiB of 2 GiB)": ({"low_peak": 2300.0}, 1),
    "a row skipped past the deadline": ({"skipped": True}, 1),
    "a synchronisation counted (none: 1)": ({"syncs": 1}, 1),
    "an audited image over its tolerance (4 levels of 3)": ({"audit_diff": 4.0}, 1),
}  # fmt: skip


def self_test() -> int:
    """The verdict code fed planted rows: one line per case with the exit code a real run would
    give; 0 only when every planted fault gives 1 and the clean set 0."""
    wrong = 0
    for case, (faults, expected) in SELF_TEST_CASES.items():
        code = exit_code(planted_rows(**faults))
        wrong += code != expected
        mark = "ok" if code == expected else f"WRONG, expected exit {expected}"
        print(f"self-test: {case}: exit {code} ({mark})", flush=True)
    print(f"self-test: {len(SELF_TEST_CASES) - wrong} of {len(SELF_TEST_CASES)} cases right")
    return 1 if wrong else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=ROOT / "bench_results" / "gpu_check.json")
    parser.add_argument("--only", default="", help=f"comma-separated rows, of {', '.join(ROWS)}")
    parser.add_argument(
        "--work_dir",
        type=Path,
        default=None,
        help="keep every run here (default: a temporary folder, removed)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=TOTAL_SECONDS,
        help="time budget; rows not started by then are skipped",
    )
    parser.add_argument(
        "--self_test",
        action="store_true",
        help="on any machine: the verdict code fed planted rows (a clean set and each fault)",
    )
    args = parser.parse_args(argv)
    args.rows = [n for n in args.only.split(",") if n] or [n for n in ROWS if n not in ON_REQUEST]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown row(s) {unknown}; choose from {list(ROWS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_test:
        return self_test()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing was measured")
        return 0
    gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    installed = versions()
    print(f"gpu_check: {len(args.rows)} rows on {gpus} x {name}", flush=True)
    print("  " + ", ".join(f"{k} {v}" for k, v in installed.items()), flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        bench = Bench(work, name, deadline=started + args.seconds)
        rows = [measure(row, bench) for row in args.rows]
    seconds = time.monotonic() - started
    print("\n" + format_table(rows) + f"\ntotal {seconds:.0f}s")
    report = {
        "device": name,
        "gpus": gpus,
        "seconds": round(seconds, 1),
        "versions": installed,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"Wrote {args.output}")
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())

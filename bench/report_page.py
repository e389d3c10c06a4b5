#!/usr/bin/env python
"""The size and build time of a run's report page (``<log_dir>/report.html``) against its
limits: 8 MB, 15 s on 2 cores at 1,000 classes.

    python bench/report_page.py                         # 1,000 classes, 10 photos each, 60 epochs
    python bench/report_page.py --classes 90 --per_class 12
    python bench/report_page.py --log_dir logs/demo     # the page of a run of yours

The made-up run is a log folder as a 2-process run with EMA leaves it (tests/support/
report_folder.py) whose validation images are photo-like JPEGs (short side 256 px), written
once per call in a temporary folder; the page reads its pictures from them, as after a real
run. Each build runs ``--repeats`` times in a new interpreter (as ``src/utils.py --report``
does: its imports counted), its median reported; exit 1 over a limit. No torch.
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

from support.harness import class_names, write_photo_folder  # noqa: E402
from support.report_folder import write_log_folder  # noqa: E402

MAX_BYTES = 8 * 2**20
MAX_SECONDS = 15.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log_dir", type=Path, help="a run's log folder (default: a made-up one)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--per_class", type=int, default=10, help="validation images per class")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def build(log_dir: Path, output: Path) -> float:
    """Seconds ``src/utils.py --report`` takes, from its start to its end."""
    started = time.perf_counter()
    command = [sys.executable, str(ROOT / "src" / "utils.py"), "--report", str(log_dir)]
    subprocess.run([*command, "--output", str(output)], check=True, capture_output=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir
        if log_dir is None:
            log_dir, val = Path(tmp) / "logs", Path(tmp) / "val"
            log_dir.mkdir()
            started = time.perf_counter()
            write_photo_folder(val, args.classes, args.per_class, 256, panorama=False, threads=2)
            classes = class_names(args.classes)
            write_log_folder(log_dir, classes, args.epochs, args.per_class, val)
            print(
                f"made {args.classes * args.per_class} photos in {time.perf_counter() - started:.1f} s"
            )
        output = Path(tmp) / "report.html"
        seconds = [build(log_dir, output) for _ in range(args.repeats)]
        size = output.stat().st_size
    what = (
        f"{log_dir}"
        if args.log_dir
        else (
            f"{args.classes} classes, {args.classes * args.per_class} validation photos, "
            f"{args.epochs} epochs"
        )
    )
    median = statistics.median(seconds)
    print(f"report page of {what}:")
    print(
        f"  size   {size / 2**20:6.2f} MB  (limit {MAX_BYTES / 2**20:.0f} MB) {verdict(size, MAX_BYTES)}"
    )
    print(
        f"  build  {median:6.2f} s   (limit {MAX_SECONDS:.0f} s; "
        f"runs: {', '.join(f'{s:.2f}' for s in seconds)}; a new interpreter each) "
        + verdict(median, MAX_SECONDS)
    )
    return 0 if size <= MAX_BYTES and median <= MAX_SECONDS else 1


def verdict(value: float, limit: float) -> str:
    return "ok" if value <= limit else "OVER"


if __name__ == "__main__":
    sys.exit(main())

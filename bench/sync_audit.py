"""Host-device synchronisations and dispatched ops of 10 training steps on CUDA, counted per
step by tests/support/sync_audit.py's ``SyncAudit`` (a ``TorchDispatchMode``, with
``torch.cuda.set_sync_debug_mode("warn")``), written as JSON, with a torch.profiler trace of the
steps if asked. The pass/fail check is ``tests/gpu/test_sync_audit_on_cuda.py``.

    python bench/sync_audit.py --source gpu --precision fp16 --output sync.json
    python bench/sync_audit.py --source ram --output sync.json --trace steps.json

Exit code 1 when a step between logging steps synchronised.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support/: what the tests and the benchmarks share

from support.harness import write_image_folder  # noqa: E402
from support.sync_audit import audit_run  # noqa: E402

CLASSES = ["cat", "dog", "fox"]


def profile_steps(train: Path, val: Path, source: str, precision: str, trace: Path) -> None:
    """A torch.profiler trace (Chrome format) of one more epoch of the same run."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=False) as prof:
        audit_run(train, val, source, 4, precision, device="cuda", log_interval=5)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="sync audit of 10 training steps on CUDA")
    parser.add_argument("--source", choices=["gpu", "ram", "none"], required=True)
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16")
    parser.add_argument("--output", type=Path, required=True, help="JSON summary")
    parser.add_argument("--trace", type=Path, default=None, help="also a profiler trace here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """10 steps (batch 4, 42 images) audited on CUDA; exit 1 on a sync between log steps."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sync_audit_") as tmp:
        root = Path(tmp)
        train = write_image_folder(root / "train", CLASSES, 14, size=20, seed=1)
        val = write_image_folder(root / "val", CLASSES, 2, size=20, seed=2)
        result = audit_run(train, val, args.source, 4, args.precision, device="cuda").summary()
        if args.trace is not None:
            profile_steps(train, val, args.source, args.precision, args.trace)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    bad = result["unexpected_syncs"] + result["unexpected_cuda_warnings"]
    print(
        f"--cache_images {args.source}, {args.precision}: {result['steps']} steps, "
        f"{sum(result['syncs_per_window'].values())} syncs ({len(bad)} between logging steps, "
        f"target 0), ops per plain step {max(result['ops_per_plain_step'], default=0)}; "
        f"wrote {args.output}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

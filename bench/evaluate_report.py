"""Does the evaluation report scale with the number of classes? evaluate.py's wall time against
its own evaluation pass, at 10 and at 1,000 classes.

    python bench/evaluate_report.py                 # 10 and 1,000 classes, 1,000 images, 16 px
    python bench/evaluate_report.py --classes 90 --images 900 --image_size 64

For each class count it generates an ImageFolder and an untrained checkpoint, times
``python -c "import torch, torchvision, timm"`` (what any run pays before its first line) and
runs ``src/evaluate.py`` once, reading the evaluation pass and report times it logs. The target:
the whole run within twice the evaluation pass plus a few seconds (imports, loading).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from harness import class_names, write_image_folder  # noqa: E402


def write_set(root: Path, classes: int, images: int, image_size: int) -> Path:
    """An ImageFolder of ``images`` noise images (a whole number a class) in ``classes`` class
    folders, and an untrained ResNet18 checkpoint of the trainer's format for them."""
    import torch

    from imgtrainer.models import build_model

    names = class_names(classes)
    write_image_folder(root / "val", names, max(1, images // classes), image_size, coloured=False)
    torch.manual_seed(0)
    torch.save(
        {
            "model_state_dict": build_model("resnet18", classes).state_dict(),
            "class_names": names,
            "image_size": image_size,
            "model_name": "resnet18",
        },
        root / "checkpoint.pth",
    )
    return root


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return time.perf_counter() - started, result.stdout + result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--image_size", type=int, default=16)
    args = parser.parse_args()
    import_seconds, _ = timed([sys.executable, "-c", "import torch, torchvision, timm"])
    print(f"import torch, torchvision, timm: {import_seconds:.1f}s")
    print(
        f"{'classes':>7}  {'images':>6}  {'wall':>6}  {'pass':>6}  {'report':>6}  "
        f"{'(wall - import) / pass':>22}"
    )
    for classes in args.classes:
        with tempfile.TemporaryDirectory() as tmp:
            root = write_set(Path(tmp), classes, args.images, args.image_size)
            wall, output = timed(
                [
                    sys.executable,
                    "src/evaluate.py",
                    "--checkpoint",
                    str(root / "checkpoint.pth"),
                    "--data_dir",
                    str(root / "val"),
                    "--output",
                    str(root / "report"),
                    "--device",
                    "cpu",
                ]
            )
        found = re.search(r"evaluation pass ([\d.]+)s, report ([\d.]+)s", output)
        eval_pass, report = float(found[1]), float(found[2])
        print(
            f"{classes:>7}  {args.images:>6}  {wall:>5.1f}s  {eval_pass:>5.1f}s  "
            f"{report:>5.1f}s  {(wall - import_seconds) / eval_pass:>22.2f}"
        )


if __name__ == "__main__":
    main()

"""Top-k predictions of a trained checkpoint for image files and folders (searched recursively).

python src/predict.py --checkpoint checkpoints/checkpoint_best.pth photo1.jpg more_photos/ --topk 3
python src/predict.py --checkpoint checkpoints/checkpoint_best.pth more_photos/ --json > predictions.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from imgtrainer.data import open_rgb
from imgtrainer.data.host.transforms import normalize_batch
from imgtrainer.data.layouts.image_files import (
    IMAGE_EXTENSIONS,
    images_under,
)
from imgtrainer.data.loaders import loader_workers
from imgtrainer.distributed.setup import choose_device, cpu_cores_available
from imgtrainer.errors import UserError, exit_on_user_error, first_line
from imgtrainer.tools.inference import (
    Classifier,
    add_inference_arguments,
    check_inference_arguments,
    load_classifier,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="predict.py", description="Top-k class predictions for image files and folders."
    )
    parser.add_argument(
        "inputs", nargs="+", type=Path, help="image files and/or folders (searched recursively)"
    )
    add_inference_arguments(
        parser,
        32,
        "images per batch",
        "loader workers (default: min(4, cores); none for a single batch)",
    )
    parser.add_argument("--topk", type=int, default=3, help="predictions per image (default: 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_inference_arguments(args)
    if args.topk < 1:
        raise UserError(f"--topk must be positive, got {args.topk}")
    return args


def collect_images(inputs: Sequence[Path]) -> list[Path]:
    """Files as given (tried whatever their extension, so a bad one is reported, not skipped
    silently), and the image files under each folder, sorted."""
    files: list[Path] = []
    for item in inputs:
        if item.is_dir():
            found = images_under(item, lambda line: print(f"WARNING: {line}", file=sys.stderr))
            if not found:
                raise UserError(f"{item} holds no image files ({'/'.join(IMAGE_EXTENSIONS)})")
            files += found
        elif item.is_file():
            files.append(item)
        else:
            raise UserError(f"{item} does not exist")
    return files


class ImageFiles(Dataset):
    """Preprocessed images; a file that cannot be read yields a blank image and its error."""

    def __init__(self, paths: list[Path], transform: v2.Compose, image_size: int):
        self.paths = paths
        self.transform = transform
        self.blank = torch.zeros(3, image_size, image_size, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        try:
            return self.transform(open_rgb(self.paths[index])), ""
        except Exception as err:  # any decoder failure on a user's file: report it, go on
            return self.blank, first_line(err)


@torch.no_grad()
def predict(
    classifier: Classifier,
    paths: list[Path],
    topk: int,
    device: torch.device,
    batch_size: int,
    num_workers: int,
) -> list[dict[str, Any]]:
    """One record per file, in order: ``{"path", "predictions": [{"class", "probability"}]}``
    or ``{"path", "error"}``."""
    loader = DataLoader(
        ImageFiles(paths, classifier.transform, classifier.image_size),
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )
    k = min(topk, len(classifier.class_names))
    results: list[dict[str, Any]] = []
    for images, errors in loader:
        images = normalize_batch(images.to(device), classifier.mean, classifier.std)
        if classifier.plan.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with classifier.precision.autocast(device):
            logits = classifier.model(images)
        probabilities = logits.float().softmax(dim=1)
        top_p, top_i = (t.cpu().tolist() for t in probabilities.topk(k, dim=1))
        for j, error in enumerate(errors):
            path = str(paths[len(results)])
            if error:
                results.append({"path": path, "error": error})
                continue
            results.append(
                {
                    "path": path,
                    "predictions": [
                        {"class": classifier.class_names[i], "probability": p}
                        for i, p in zip(top_i[j], top_p[j], strict=True)
                    ],
                }
            )
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    width = min(60, max(len("file"), *(len(r["path"]) for r in results)))
    lines = [f"{'file':<{width}}  predictions (probability)"]
    for r in results:
        if "error" in r:
            shown = f"cannot read: {r['error']}"
        else:
            shown = "   ".join(f"{p['class']} {p['probability']:.3f}" for p in r["predictions"])
        lines.append(f"{r['path']:<{width}}  {shown}")
    return "\n".join(lines)


@exit_on_user_error
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    paths = collect_images(args.inputs)
    device = choose_device(args.device, local_rank=0)
    classifier = load_classifier(
        args.checkpoint, device, args.weights, args.eval_resize_ratio, args.tta
    )
    # On stderr: stdout is the table or the JSON.
    print(f"Predicting with {classifier.weights_note} of {args.checkpoint}", file=sys.stderr)
    # Loader processes only pay for themselves when there is more than one batch to read.
    few = args.num_workers is None and len(paths) <= args.batch_size
    workers = 0 if few else loader_workers(args.num_workers, cpu_cores_available(), device.type)
    results = predict(classifier, paths, args.topk, device, args.batch_size, workers)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    failed = sum("error" in r for r in results)
    if failed:
        print(f"{failed} of {len(results)} file(s) could not be read", file=sys.stderr)
    return 0

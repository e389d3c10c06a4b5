"""Evaluate a checkpoint on an ImageFolder and write a report of where the model fails.

    python src/evaluate.py --checkpoint checkpoints/checkpoint_best.pth --data_dir data/val --output logs/eval
    torchrun --nproc_per_node=2 src/evaluate.py --checkpoint checkpoints/checkpoint_best.pth --data_dir data/val

Writes metrics.json, confusion_matrix.csv, misclassified.csv and a confusion drawing to OUTPUT.
Under torchrun each image is evaluated by one process and the counts are summed: exact metrics.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imgtrainer.data import (
    FOLDER,
    LoaderSpec,
    SeededImageDataset,
    ShardSampler,
    TableImages,
    find_classes,
    layout_of,
    leave_out_unreadable,
    loader_workers,
    make_loader,
    open_table,
)
from imgtrainer.distributed.collectives import all_gather_objects, all_reduce_sum
from imgtrainer.distributed.logs import logging_for_run
from imgtrainer.distributed.setup import (
    DistInfo,
    cleanup_distributed,
    cpu_cores_available,
    setup_distributed,
)
from imgtrainer.errors import UserError, exit_on_user_error
from imgtrainer.reports.confusion import (
    FULL_MATRIX_MAX_CLASSES,
    balanced_accuracy,
    format_worst_classes,
    macro_f1,
    per_class_metrics,
    plot_confusion_matrix,
    plot_confusion_summary,
    write_confusion_csv,
)
from imgtrainer.tools.inference import (
    Classifier,
    add_inference_arguments,
    check_inference_arguments,
    load_classifier,
)
from imgtrainer.training.evaluation import EvalSettings, evaluation_sums
from imgtrainer.training.step import LOSS, TOP5

log = logging.getLogger(__name__)


WORST_CLASSES_SHOWN = 10


@dataclass
class EvalCounts:
    """Everything the report needs, summed (or gathered) over all ranks."""

    confusion: np.ndarray  # [K, K] int64, rows true, columns predicted
    loss_sum: float
    top5_correct: int
    misclassified: list[tuple[int, int, float]]  # (dataset index, predicted class, confidence)

    @property
    def images(self) -> int:
        return int(self.confusion.sum())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evaluate.py",
        description="Evaluate a checkpoint on an ImageFolder: metrics.json, "
        "confusion_matrix.png, misclassified.csv and the worst classes.",
    )
    add_inference_arguments(
        parser,
        64,
        "images per batch per process",
        "loader workers per process (default: min(4, cores per process))",
    )
    parser.add_argument(
        "--data_dir",
        type=Path,
        default=Path("data/val"),
        help="ImageFolder <dir>/<class>/<image>; its classes must be among the "
        "checkpoint's (default: data/val)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("logs/eval"),
        help="folder for the report files (default: logs/eval)",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_inference_arguments(args)
    return args


def build_eval_folder(
    data_dir: Path, class_names: list[str], output: Path, dist: DistInfo
) -> tuple[TableImages, int]:
    """The images of ``data_dir`` (a folder, or any other layout of --train_data) labelled
    with the checkpoint's class indices (the folder may hold only some of the classes), and how
    many unreadable files were left out. Every rank must call this."""
    is_folder = layout_of(str(data_dir)) == FOLDER
    present = find_classes(data_dir, "evaluation") if is_folder else []
    unknown = sorted(set(present) - set(class_names))
    if unknown:
        raise UserError(
            f"{data_dir} has class folders the checkpoint does not know: "
            f"{unknown[:10]}{' ...' if len(unknown) > 10 else ''}; its classes are "
            f"{class_names[:10]}{' ...' if len(class_names) > 10 else ''}"
        )
    folder = TableImages(open_table(str(data_dir), "evaluation", class_names))
    unreadable = leave_out_unreadable({"evaluation": folder}, output, dist.rank, dist.world_size)
    if not len(folder):
        raise UserError(f"{data_dir} holds no readable image")
    return folder, len(unreadable)


class PredictionCounter:
    """The per-sample part of the report, fed by ``training.evaluation.evaluate``'s pass: the confusion
    matrix (on the device) and this rank's misclassified images.

    ``indices`` yields the dataset index of each sample in the order the loader yields them
    (the loader's sampler): the pass sees every sample once, in that order.
    """

    def __init__(self, num_classes: int, device: torch.device, indices: Iterator[int]):
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
        self.indices = indices
        self.misclassified: list[tuple[int, int, float]] = []  # (index, predicted, confidence)

    def __call__(
        self, logits: torch.Tensor, predicted: torch.Tensor, targets: torch.Tensor
    ) -> None:
        # index_add_, not bincount: bincount on CUDA reads the largest value back to the host.
        self.confusion.index_add_(
            0,
            targets * self.num_classes + predicted,
            torch.ones_like(targets, dtype=self.confusion.dtype),
        )
        confidence = logits.softmax(dim=1).gather(1, predicted[:, None])[:, 0]
        # The per-image list needs the predictions on the host: one copy per (micro-)batch, one
        # GPU synchronisation, not one per misclassified image.
        host = torch.stack(
            [predicted.double(), confidence.double(), (predicted != targets).double()]
        ).cpu()
        batch_indices = [next(self.indices) for _ in range(targets.size(0))]
        for i in host[2].nonzero().flatten().tolist():
            self.misclassified.append((batch_indices[i], int(host[0, i]), float(host[1, i])))


def count_predictions(
    classifier: Classifier, loader, device: torch.device, show_progress: bool = True
) -> EvalCounts:
    """Confusion matrix, loss and top-5 over this rank's shard, summed over all ranks, plus every
    rank's misclassified images. Every rank must call this (it ends with collectives).

    The pass is training's own (``training.evaluation.evaluation_sums``: its autocast, micro-batch and
    layout, read from the checkpoint), so top-1 is the ``val_acc`` training recorded for the
    same checkpoint and images. ShardSampler gives each image to exactly one rank.
    """
    num_classes = len(classifier.class_names)
    counter = PredictionCounter(num_classes, device, iter(loader.sampler))
    settings = EvalSettings(device, classifier.precision, classifier.plan, show_progress)
    sums = evaluation_sums(classifier.model, loader, settings, on_predictions=counter).tolist()
    all_reduce_sum(counter.confusion)
    gathered = sorted(row for rows in all_gather_objects(counter.misclassified) for row in rows)
    return EvalCounts(
        counter.confusion.view(num_classes, num_classes).cpu().numpy(),
        sums[LOSS],
        int(sums[TOP5]),
        gathered,
    )


def build_metrics(
    counts: EvalCounts,
    class_names: list[str],
    args: argparse.Namespace,
    unreadable: int,
    classifier: Classifier,
) -> dict[str, Any]:
    images = max(counts.images, 1)
    correct = int(np.trace(counts.confusion))
    return {
        "checkpoint": str(args.checkpoint),
        "weights": classifier.weights,  # "ema" or "raw": which of the checkpoint's weights (--weights)
        "data_dir": str(args.data_dir),
        # How the images were seen: the metrics depend on both.
        "eval_resize_ratio": classifier.eval_resize_ratio,
        "tta": classifier.tta,
        "images": counts.images,
        "unreadable_images_left_out": unreadable,
        "classes": len(class_names),
        "correct": correct,
        "misclassified": counts.images - correct,
        "top1": correct / images,
        "top5": counts.top5_correct / images,
        "loss": counts.loss_sum / images,
        # Every class counts the same: what top-1 hides when the classes differ in size.
        "balanced_accuracy": balanced_accuracy(counts.confusion),
        "macro_f1": macro_f1(counts.confusion),
        "per_class": per_class_metrics(counts.confusion, class_names),
        "class_names": class_names,
        # rows: true class, columns: predicted. Inlined only while it stays readable; the CSV
        # always has it.
        **(
            {"confusion_matrix": counts.confusion.tolist()}
            if len(class_names) <= FULL_MATRIX_MAX_CLASSES
            else {}
        ),
        "confusion_matrix_csv": "confusion_matrix.csv",
    }


class ReportWriter:
    """Writes the three report files; a no-op on every process but the main one."""

    def __init__(self, output: Path, enabled: bool):
        self.output = output
        self.enabled = enabled

    def write(self, metrics: dict[str, Any], counts: EvalCounts, folder: TableImages) -> list[Path]:
        """The files written, in the order a reader wants them."""
        if not self.enabled:
            return []
        self.output.mkdir(parents=True, exist_ok=True)
        files = [
            self.output / "metrics.json",
            self.output / "confusion_matrix.csv",
            self.output / "misclassified.csv",
        ]
        files[0].write_text(json.dumps(metrics, indent=2) + "\n")
        class_names = metrics["class_names"]
        write_confusion_csv(counts.confusion, class_names, files[1])
        self.write_misclassified(counts, folder)
        title = f"{metrics['data_dir']}: top-1 {metrics['top1']:.3f}, {metrics['images']} images"
        if len(class_names) <= FULL_MATRIX_MAX_CLASSES:
            files.append(self.output / "confusion_matrix.png")
            plot_confusion_matrix(counts.confusion, class_names, files[-1], title)
        else:
            files.append(self.output / "confusion_summary.png")
            plot_confusion_summary(
                counts.confusion, class_names, metrics["per_class"], files[-1], title
            )
        return files

    def write_misclassified(self, counts: EvalCounts, folder: TableImages) -> None:
        """Most confident mistakes first: they are the likeliest label errors in the data."""
        rows = sorted(counts.misclassified, key=lambda row: -row[2])
        with open(self.output / "misclassified.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "true_class", "predicted_class", "confidence"])
            for index, predicted, confidence in rows:
                path, target = folder.table.location(index), folder.table.label(index)
                writer.writerow(
                    [path, folder.classes[target], folder.classes[predicted], f"{confidence:.4f}"]
                )


def run(args: argparse.Namespace, dist: DistInfo) -> int:
    with logging_for_run(args.output, dist, name="evaluate"):
        return evaluate_and_report(args, dist)


def evaluate_and_report(args: argparse.Namespace, dist: DistInfo) -> int:
    classifier: Classifier = load_classifier(
        args.checkpoint, dist.device, args.weights, args.eval_resize_ratio, args.tta
    )
    folder, unreadable = build_eval_folder(args.data_dir, classifier.class_names, args.output, dist)
    dataset = SeededImageDataset(folder, classifier.transform, seed=0)
    workers = loader_workers(
        args.num_workers, cpu_cores_available() // dist.local_world_size, dist.device.type
    )
    loader = make_loader(
        dataset,
        ShardSampler(len(dataset), dist.rank, dist.world_size),
        LoaderSpec(
            args.batch_size,
            train=False,
            num_workers=workers,
            pin_memory=dist.device.type == "cuda",
            mean=classifier.mean,
            std=classifier.std,
        ),
    )
    log.info(
        f"Evaluating {args.checkpoint} on {len(dataset)} images of {args.data_dir} "
        f"({dist.world_size} process(es) on {dist.device.type}) with {classifier.weights_note}; "
        f"resize ratio {classifier.eval_resize_ratio}, test-time augmentation: {classifier.tta}"
    )
    started = time.perf_counter()
    counts = count_predictions(classifier, loader, dist.device, show_progress=dist.is_main)
    evaluated = time.perf_counter()
    metrics = build_metrics(counts, classifier.class_names, args, unreadable, classifier)
    written = ReportWriter(args.output, enabled=dist.is_main).write(metrics, counts, folder)
    log.info(
        f"Timing: evaluation pass {evaluated - started:.2f}s, report "
        f"{time.perf_counter() - evaluated:.2f}s"
    )
    log.info(
        f"top-1 {metrics['top1']:.4f}  top-5 {metrics['top5']:.4f}  loss "
        f"{metrics['loss']:.4f}  ({metrics['correct']}/{metrics['images']} correct)  "
        f"balanced accuracy {metrics['balanced_accuracy']:.4f}  macro F1 "
        f"{metrics['macro_f1']:.4f}"
    )
    log.info(format_worst_classes(metrics["per_class"], WORST_CLASSES_SHOWN))
    if written:
        log.info("Wrote " + ", ".join(map(str, written)))
    return 0


@exit_on_user_error
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    dist = setup_distributed(args.device)
    try:
        return run(args, dist)
    finally:
        cleanup_distributed()

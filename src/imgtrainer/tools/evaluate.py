"""Evaluate a checkpoint on an ImageFolder and write a report of where the model fails.

    python src/evaluate.py --checkpoint checkpoints/checkpoint_best.pth --data_dir data/val --output logs/eval --report
    torchrun --nproc_per_node=2 src/evaluate.py --checkpoint checkpoints/checkpoint_best.pth --data_dir data/val

Writes metrics.json, confusion_matrix.csv, misclassified.csv, a confusion drawing and with
--report report.html to OUTPUT. Under torchrun each image is evaluated by one process: exact.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from imgtrainer.distributed.logs import logging_for_run
from imgtrainer.distributed.setup import (
    DistInfo,
    cleanup_distributed,
    setup_distributed,
)
from imgtrainer.errors import exit_on_user_error
from imgtrainer.files import csv_text
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
from imgtrainer.reports.page.evaluation_report import build_evaluation_report
from imgtrainer.reports.page.run_report import REPORT_NAME
from imgtrainer.reports.page.thumbnails import DataImages
from imgtrainer.tools.inference import (
    Classifier,
    add_inference_arguments,
    check_inference_arguments,
    load_classifier,
)
from imgtrainer.tools.scoring import EvalCounts, build_eval_folder, score

log = logging.getLogger(__name__)


WORST_CLASSES_SHOWN = 10


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evaluate.py",
        description="Evaluate a checkpoint on an ImageFolder: metrics.json, "
        "confusion_matrix.png, misclassified.csv and the worst classes (--report: a page with "
        "the images it gets wrong).",
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
    parser.add_argument(
        "--report",
        action="store_true",
        help="also write OUTPUT/report.html: one page with the per-class table, the confusion "
        "matrix and the images it gets wrong as pictures",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_inference_arguments(args)
    return args


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

    def write(self, metrics: dict[str, Any], counts: EvalCounts) -> list[Path]:
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
        self.write_misclassified(counts)
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

    def write_page(
        self, metrics: dict[str, Any], counts: EvalCounts, classifier: Classifier, table
    ) -> list[Path]:
        """--report: report.html, the pictures of the mistakes read from ``table``."""
        if not self.enabled:
            return []
        images = DataImages(metrics["data_dir"], counts.predictions.class_names, table=table)
        text = build_evaluation_report(counts.predictions, metrics, classifier.history, images)
        path = self.output / REPORT_NAME
        path.write_text(text)
        return [path]

    def write_misclassified(self, counts: EvalCounts) -> None:
        """Most confident mistakes first: they are the likeliest label errors in the data."""
        p, names = counts.predictions, counts.predictions.class_names
        rows = sorted(counts.misclassified, key=lambda row: -row[2])
        with open(self.output / "misclassified.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "true_class", "predicted_class", "confidence"])
            for index, predicted, confidence in rows:
                target = p.targets[index]
                texts = (p.locations[index], names[target], names[predicted])
                writer.writerow([*map(csv_text, texts), f"{confidence:.4f}"])


def run(args: argparse.Namespace, dist: DistInfo) -> int:
    with logging_for_run(args.output, dist, name="evaluate"):
        return evaluate_and_report(args, dist)


def evaluate_and_report(args: argparse.Namespace, dist: DistInfo) -> int:
    classifier: Classifier = load_classifier(
        args.checkpoint, dist.device, args.weights, args.eval_resize_ratio, args.tta
    )
    folder, unreadable = build_eval_folder(args.data_dir, classifier.class_names, args.output, dist)
    started = time.perf_counter()
    counts = score(classifier, folder, args, dist)
    evaluated = time.perf_counter()
    metrics = build_metrics(counts, classifier.class_names, args, unreadable, classifier)
    writer = ReportWriter(args.output, enabled=dist.is_main)
    written = writer.write(metrics, counts)
    if args.report:
        written += writer.write_page(metrics, counts, classifier, folder.table)
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

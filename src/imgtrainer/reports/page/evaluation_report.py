"""The report page of one checkpoint evaluated on any data (``src/evaluate.py --report``).

The run report's sections for its predictions (classes, confusion, mistakes as pictures), the
checkpoint's own training curves from the history it carries, and what was evaluated how.
"""

from __future__ import annotations

from typing import Any

from imgtrainer.reports.page.html import (
    Section,
    cards,
    esc,
    folded,
    number,
    page,
    percent,
    table,
    text,
)
from imgtrainer.reports.page.report_page import classes_section, curves_section, mistakes_section
from imgtrainer.reports.page.thumbnails import ImageReader
from imgtrainer.reports.predictions import Predictions


def build_evaluation_report(
    predictions: Predictions,
    metrics: dict[str, Any],
    history: dict[str, Any] | None,
    read_image: ImageReader,
) -> str:
    """``metrics``: evaluate.py's metrics.json; ``history``: the checkpoint's (its config, its
    epoch records and best epoch), or None."""
    about = (
        f"{metrics['checkpoint']} ({metrics['weights']} weights) on {metrics['data_dir']}: every "
        f"image as the checkpoint predicted it."
    )
    counts = (history or {}).get("train_class_counts")
    sections = [
        classes_section(predictions, counts),
        mistakes_section(predictions, read_image, about),
    ]
    if history and history.get("epochs"):
        sections.append(curves_section(history))
    sections.append(evaluated_section(metrics, history))
    head = (
        "<p class='lead'>"
        + esc(about)
        + "</p>"
        + cards(
            [
                (percent(metrics["top1"], 2), "top-1"),
                (percent(metrics["top5"], 2), "top-5"),
                (number(metrics["loss"]), "loss"),
                (percent(metrics["balanced_accuracy"], 2), "balanced accuracy"),
                (number(metrics["macro_f1"]), "macro F1"),
                (str(metrics["images"]), "images"),
            ]
        )
    )
    return page(f"Evaluation: {metrics['checkpoint']}", head, sections)


def evaluated_section(metrics: dict[str, Any], history: dict[str, Any] | None) -> Section:
    rows = [
        ("checkpoint", metrics["checkpoint"]),
        ("weights", metrics["weights"]),
        ("data", metrics["data_dir"]),
        ("images evaluated", metrics["images"]),
        ("unreadable images left out", metrics["unreadable_images_left_out"]),
        ("resize ratio", metrics["eval_resize_ratio"]),
        ("test-time augmentation", metrics["tta"]),
    ]
    body = table(["", ""], [[text(k), text(v)] for k, v in rows])
    config = (history or {}).get("config")
    if config:
        lines = "\n".join(f"{key}: {value}" for key, value in config.items())
        body += folded("The training run's configuration", f"<pre>{esc(lines)}</pre>")
    return Section("evaluated", "What was evaluated", body)

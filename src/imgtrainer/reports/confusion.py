"""What a confusion matrix says: per-class metrics, the worst classes, readable plots, and the
matrix as CSV.

Pure functions of the matrix (rows: true class, columns: predicted class), so they are easy to
check by hand; nothing here knows about models, ranks or loaders.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from imgtrainer.files import csv_text
from imgtrainer.reports.figures import new_figure, save_figure

# Up to this many classes the full matrix is drawn with every class named; above it a drawing
# of K x K cells is neither readable nor cheap (1,000 classes need gigabytes and minutes),
# so the report draws the most-confused pairs and the worst classes instead.
FULL_MATRIX_MAX_CLASSES = 100


PAIRS_SHOWN = 30


def ratio(numerator: float, denominator: float) -> float | None:
    """None where the ratio is undefined (no images of a class, no prediction of it)."""
    return float(numerator / denominator) if denominator else None


def per_class_metrics(confusion: np.ndarray, class_names: Sequence[str]) -> dict[str, dict]:
    """Precision, recall, F1 and accuracy of every class, with the counts behind them.

    A class's accuracy is the share of its own images predicted right (the same number as its
    recall; reported under both names because readers look for either).
    """
    images = confusion.sum(axis=1)
    predicted = confusion.sum(axis=0)
    correct = np.diag(confusion)
    metrics = {}
    for k, name in enumerate(class_names):
        precision = ratio(correct[k], predicted[k])
        recall = ratio(correct[k], images[k])
        f1 = (
            2 * precision * recall / (precision + recall)
            if precision and recall
            else (0.0 if images[k] else None)
        )
        metrics[name] = {
            "images": int(images[k]),
            "predicted": int(predicted[k]),
            "correct": int(correct[k]),
            "precision": precision,
            "recall": recall,
            "accuracy": recall,
            "f1": f1,
            "most_confused_with": most_confused_with(confusion, k, class_names),
        }
    return metrics


def balanced_accuracy(confusion: np.ndarray) -> float | None:
    """The mean of the per-class recalls over the classes that have images (scikit-learn's
    ``balanced_accuracy_score``): every class counts the same, whatever its size."""
    images = confusion.sum(axis=1)
    present = images > 0
    if not present.any():
        return None
    return float((np.diag(confusion)[present] / images[present]).mean())


def macro_f1(confusion: np.ndarray) -> float | None:
    """The mean F1 over the classes that have images or predictions (scikit-learn's
    ``f1_score(average="macro")``; a class never predicted right scores 0)."""
    images, predicted = confusion.sum(axis=1), confusion.sum(axis=0)
    seen = (images + predicted) > 0
    if not seen.any():
        return None
    # F1 = 2 TP / (2 TP + FP + FN) = 2 correct / (images + predicted)
    return float((2 * np.diag(confusion)[seen] / (images + predicted)[seen]).mean())


def most_confused_with(
    confusion: np.ndarray, k: int, class_names: Sequence[str]
) -> dict[str, Any] | None:
    """The class that images of class ``k`` are most often mistaken for, and how often."""
    row = confusion[k].copy()
    row[k] = 0
    if row.sum() == 0:
        return None
    j = int(row.argmax())
    return {"class": class_names[j], "images": int(row[j])}


def worst_classes(metrics: dict[str, dict], count: int) -> list[str]:
    """The ``count`` classes with the lowest accuracy (more images first among ties); classes
    without images are left out."""
    rated = [name for name, m in metrics.items() if m["accuracy"] is not None]
    return sorted(
        rated, key=lambda name: (metrics[name]["accuracy"], -metrics[name]["images"], name)
    )[:count]


def format_worst_classes(metrics: dict[str, dict], count: int) -> str:
    names = worst_classes(metrics, count)
    width = max([len("class"), *map(len, names)])
    lines = [
        f"Worst {len(names)} classes by accuracy:",
        f"  {'class':<{width}}  images  accuracy  precision  most often predicted as",
    ]
    for name in names:
        m = metrics[name]
        precision = "-" if m["precision"] is None else f"{m['precision']:.3f}"
        confused = m["most_confused_with"]
        confused = "-" if confused is None else f"{confused['class']} ({confused['images']})"
        lines.append(
            f"  {name:<{width}}  {m['images']:>6}  {m['accuracy']:>8.3f}  "
            f"{precision:>9}  {confused}"
        )
    return "\n".join(lines)


def most_confused_pairs(confusion: np.ndarray, count: int) -> list[tuple[int, int, int]]:
    """The ``count`` largest off-diagonal cells as (true class, predicted class, images), largest
    first, ties in matrix order (a stable sort)."""
    off = confusion.astype(np.int64, copy=True)
    np.fill_diagonal(off, 0)
    flat = off.reshape(-1)
    count = min(count, int(np.count_nonzero(flat)))
    top = np.argsort(-flat, kind="stable")[:count]
    k = confusion.shape[0]
    return [(int(i // k), int(i % k), int(flat[i])) for i in top]


def write_confusion_csv(confusion: np.ndarray, class_names: Sequence[str], output: Path) -> None:
    """The whole matrix with named rows (true class) and columns (predicted class)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["true \\ predicted", *map(csv_text, class_names)])
        for name, row in zip(class_names, confusion.tolist(), strict=True):
            writer.writerow([csv_text(name), *row])


def plot_confusion_summary(
    confusion: np.ndarray,
    class_names: Sequence[str],
    metrics: dict[str, dict],
    output: Path,
    title: str,
) -> None:
    """For many classes: the most-confused pairs (share of the true class's images) and the
    classes with the lowest accuracy, as two bar charts of fixed size."""
    pairs = most_confused_pairs(confusion, PAIRS_SHOWN)
    rows = confusion.sum(axis=1)
    worst = worst_classes(metrics, PAIRS_SHOWN)
    fig, (left, right) = new_figure(1, 2, figsize=(16, 0.28 * PAIRS_SHOWN + 2.5))
    labels = [f"{class_names[i]} -> {class_names[j]} ({n})" for i, j, n in pairs]
    left.barh(range(len(pairs)), [n / rows[i] for i, _, n in pairs], color="tab:red")
    left.set_yticks(range(len(pairs)), labels=labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("share of the true class's images")
    left.set_title(f"{len(pairs)} most-confused pairs (true -> predicted, images)")
    accuracies = [metrics[name]["accuracy"] for name in worst]
    right.barh(range(len(worst)), accuracies, color="tab:blue")
    for y, accuracy in enumerate(accuracies):  # a zero-length bar still shows its value
        right.text(accuracy + 0.01, y, f"{accuracy:.2f}", va="center", fontsize=8)
    right.set_yticks(
        range(len(worst)),
        labels=[f"{name} ({metrics[name]['images']})" for name in worst],
        fontsize=8,
    )
    right.invert_yaxis()
    right.set_xlim(0, 1)
    right.set_xlabel("accuracy")
    right.set_title(f"{len(worst)} worst classes (images)")
    fig.suptitle(f"{title}; {len(class_names)} classes: full matrix in confusion_matrix.csv")
    save_figure(fig, output, dpi=100)


def plot_confusion_matrix(
    confusion: np.ndarray, class_names: Sequence[str], output: Path, title: str
) -> None:
    """Row-normalised (each row sums to 1, so rare and common classes read alike), every class
    named on both axes, the figure grown with the number of classes so 90 labels stay legible;
    counts are written in the cells when there are few enough classes for them to fit."""
    from matplotlib.colors import PowerNorm

    k = len(class_names)
    rows = confusion.sum(axis=1, keepdims=True)
    normalised = np.divide(
        confusion, rows, out=np.zeros(confusion.shape, dtype=float), where=rows > 0
    )
    side = max(6.0, 0.24 * k + 3.0)  # inches: about 0.24 in (~24 px) per class
    font = 10 if k <= 20 else 8
    fig, ax = new_figure(figsize=(side + 1.5, side))
    # A square-root colour scale: one mistake in 12 images (0.08) still shows clearly.
    shown = ax.imshow(
        normalised, cmap="Blues", norm=PowerNorm(0.5, vmin=0.0, vmax=1.0), interpolation="nearest"
    )
    ax.set_xticks(range(k), labels=class_names, rotation=90 if k > 12 else 0, fontsize=font)
    ax.set_yticks(range(k), labels=class_names, fontsize=font)
    ax.set_xlabel("predicted class", fontsize=font + 3)
    ax.set_ylabel("true class", fontsize=font + 3)
    ax.set_title(title, fontsize=font + 6)
    # Faint lines between cells help follow a row or a column across a large matrix.
    ax.set_xticks(np.arange(-0.5, k), minor=True)
    ax.set_yticks(np.arange(-0.5, k), minor=True)
    ax.grid(which="minor", color="0.85", linewidth=0.4)
    ax.tick_params(which="minor", length=0)
    if k <= 30:
        for i in range(k):
            for j in range(k):
                if confusion[i, j]:
                    ax.text(
                        j,
                        i,
                        str(int(confusion[i, j])),
                        ha="center",
                        va="center",
                        fontsize=font - 1,
                        color="white" if normalised[i, j] > 0.5 else "black",
                    )
    colorbar = fig.colorbar(shown, ax=ax, fraction=0.035, pad=0.02)
    colorbar.set_label("share of the true class's images", fontsize=font + 2)
    save_figure(fig, output, dpi=100)

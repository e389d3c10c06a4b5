"""The sections of a report page drawn from a history and from predictions.

The curves, every epoch's record, the per-class table, the confusion matrix, class sizes and
the mistakes.

Shared by the run's report (``run_report``) and the evaluation tool's (``--report``). Any field
an epoch record holds is shown (the table and the other curves), not a fixed set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from imgtrainer.reports.confusion import (
    FULL_MATRIX_MAX_CLASSES,
    PAIRS_SHOWN,
    balanced_accuracy,
    macro_f1,
    most_confused_pairs,
    per_class_metrics,
)
from imgtrainer.reports.page.curves import other_charts, report_charts
from imgtrainer.reports.page.html import (
    Cell,
    Section,
    esc,
    folded,
    number,
    percent,
    table,
    text,
)
from imgtrainer.reports.page.thumbnails import ImageReader, thumbnail_uri
from imgtrainer.reports.predictions import Predictions

# The highest-loss images shown, and the worst classes given a row of their mistakes.
GALLERY_IMAGES = 24
WORST_CLASS_ROWS = 8
ROW_IMAGES = 8
# The per-class table's rows at most (the worst classes): a page of 20,000 classes stays small.
PER_CLASS_ROWS = 2000
# Up to this many classes the matrix's cells show their counts.
COUNTS_IN_CELLS_MAX_CLASSES = 30


def best_epoch(history: dict[str, Any] | None) -> int | None:
    """The best epoch the run recorded (its --best_metric), None before one."""
    best = (history or {}).get("best") or {}
    return best.get("epoch")


# ----------------------------------------------------------------------------- curves


def curves_section(history: dict[str, Any]) -> Section:
    records = history["epochs"]
    best = best_epoch(history)
    parts = [figures(report_charts(history, best))]
    others = other_charts(history)
    if others:
        title = f"Every other figure of the epoch records ({len(others)} charts)"
        parts.append(folded(title, figures(others)))
    parts.append(folded(f"The epoch records ({len(records)})", epochs_table(records, best)))
    return Section("curves", "Curves", "\n".join(parts))


def figures(charts: list[str]) -> str:
    """Charts side by side, one under another on a narrow screen."""
    return f"<div class='figures'>{''.join(charts)}</div>"


def epochs_table(records: Sequence[dict[str, Any]], best: int | None) -> str:
    """Every field of every record, a column per field in the order they first appear; the
    best epoch in bold."""
    columns: dict[str, None] = {}
    for record in records:
        columns.update(dict.fromkeys(record))
    rows = []
    for record in records:
        cells = [number(record.get(column)) for column in columns]
        if record.get("epoch") == best:
            cells = [f"<b>{cell}</b>" for cell in cells]
        rows.append(cells)
    return table(list(columns), rows, table_id="epochs", tall=True)


# ----------------------------------------------------------------------------- classes


def worst_first(metrics: dict[str, dict]) -> list[str]:
    """Classes by F1, worst first (then recall, then the larger class); classes without
    images or predictions last."""

    def key(name: str) -> tuple:
        m = metrics[name]
        rated = m["f1"] is not None
        return (not rated, m["f1"] or 0.0, m["recall"] or 0.0, -m["images"], name)

    return sorted(metrics, key=key)


def classes_section(predictions: Predictions, train_counts: Sequence[int] | None) -> Section:
    names = predictions.class_names
    confusion = predictions.confusion()
    metrics = per_class_metrics(confusion, names)
    lead = (
        f"<p class='lead'>{len(predictions)} images, {len(names)} classes: top-1 "
        f"{percent(predictions.top1, 2)}, balanced accuracy "
        f"{percent(balanced_accuracy(confusion), 2)}, macro F1 "
        f"{number(macro_f1(confusion))}.</p>"
    )
    parts = [lead, "<h3>Per class, worst first</h3>", per_class_table(metrics, names, train_counts)]
    parts.append(sizes_block(confusion.sum(axis=1), train_counts, names))
    parts.append("<h3>Confusion matrix</h3>")
    if len(names) <= FULL_MATRIX_MAX_CLASSES:
        parts.append(matrix_table(confusion, names))
    else:
        parts.append(
            f"<p class='note'>{len(names)} classes: the full matrix is not drawn; the "
            "most-confused pairs are below (evaluate.py writes the whole matrix as CSV).</p>"
        )
    parts.append(pairs_table(confusion, names))
    return Section("classes", "Classes", "\n".join(parts))


def per_class_table(
    metrics: dict[str, dict], names: Sequence[str], train_counts: Sequence[int] | None
) -> str:
    index = {name: k for k, name in enumerate(names)}
    # Classes named by their numbers (the digits "0".."9"): no column repeating the name.
    numbered = any(name != str(k) for k, name in enumerate(names))
    largest = max(train_counts or [1]) or 1
    headers = [*(["#"] if numbered else []), "class", "images", "correct", "precision"]
    headers += ["recall", "F1", "most often taken for"]
    headers += ["training images"] if train_counts else []
    rows = []
    order = worst_first(metrics)
    for name in order[:PER_CLASS_ROWS]:
        m = metrics[name]
        confused = m["most_confused_with"]
        row = [
            *([str(index[name])] if numbered else []),
            text(name),
            str(m["images"]),
            str(m["correct"]),
            number(m["precision"], 3),
            number(m["recall"], 3),
            number(m["f1"], 3),
            text(f"{confused['class']} ({confused['images']})" if confused else "–"),
        ]
        if train_counts:
            count = train_counts[index[name]]
            bar = f"<span class='bar' style='width:{60 * count / largest:.0f}px'></span>"
            row.append(Cell(f"{count} {bar}", text=True))
        rows.append(row)
    left_out = len(order) - PER_CLASS_ROWS
    note = (
        f"<p class='note'>The {left_out} best classes are left out (the page stays small); "
        "evaluate.py's metrics.json has every class.</p>"
        if left_out > 0
        else ""
    )
    return table(headers, rows, table_id="per-class", tall=True) + note


def sizes_block(
    val_counts: np.ndarray, train_counts: Sequence[int] | None, names: Sequence[str]
) -> str:
    """Class sizes: the smallest and largest class of each split and their ratio."""
    lines = []
    for split, counts in (("training", train_counts), ("validation", val_counts)):
        if counts is None or not len(counts):
            continue
        counts = np.asarray(counts)
        small, large = int(counts.argmin()), int(counts.argmax())
        ratio = counts[large] / counts[small] if counts[small] else float("inf")
        lines.append(
            f"<li>{split}: {int(counts.sum())} images; smallest class {esc(names[small])} "
            f"({counts[small]}), median {np.median(counts):g}, largest {esc(names[large])} "
            f"({counts[large]}): <b>{ratio:.1f}×</b></li>"
        )
    return "<h3>Class sizes and imbalance</h3><ul>" + "".join(lines) + "</ul>"


def matrix_table(confusion: np.ndarray, names: Sequence[str]) -> str:
    """The whole matrix as a table of coloured cells (the share of the true class's images:
    blue on the diagonal, red off it), counts written in the cells for a few classes; every
    non-empty cell names its pair when pointed at."""
    k = len(names)
    rows = confusion.sum(axis=1)
    counts_shown = k <= COUNTS_IN_CELLS_MAX_CLASSES
    head = "".join(f"<th title='{esc(n)}'>{j}</th>" for j, n in enumerate(names))
    body = []
    for i, name in enumerate(names):
        cells = []
        for j in range(k):
            n = int(confusion[i, j])
            if not n:
                cells.append("<td></td>")
                continue
            share = n / rows[i]
            colour = "36,99,166" if i == j else "192,57,43"
            ink = "#fff" if share > 0.5 else "#000"
            cells.append(
                f"<td style='background:rgba({colour},{0.15 + 0.85 * share**0.5:.2f});"
                f"color:{ink}' title='{esc(name)} → {esc(names[j])}: {n}'>"
                f"{n if counts_shown else ''}</td>"
            )
        label = esc(name) if name == str(i) else f"{i} {esc(name)}"  # digits: "3", not "3 3"
        body.append(f"<tr><th class='text'>{label}</th>{''.join(cells)}</tr>")
    return (
        "<p class='note'>Rows: the true class; columns: the predicted class, numbered as the "
        "rows. The colour is the share of the true class's images.</p>"
        f"<div class='scroll'><table class='matrix{' counts' * counts_shown}' id='confusion'>"
        f"<thead><tr><th></th>{head}"
        f"</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def pairs_table(confusion: np.ndarray, names: Sequence[str]) -> str:
    pairs = most_confused_pairs(confusion, PAIRS_SHOWN)
    if not pairs:
        return "<p>No image was taken for another class.</p>"
    rows = confusion.sum(axis=1)
    body = [[text(names[i]), text(names[j]), str(n), percent(n / rows[i])] for i, j, n in pairs]
    headers = ["true class", "taken for", "images", "of the true class"]
    return f"<h3>The {len(pairs)} most-confused pairs</h3>" + table(headers, body, "pairs")


# ----------------------------------------------------------------------------- mistakes


def mistakes_section(predictions: Predictions, read_image: ImageReader, about: str) -> Section:
    tiles = Tiles(predictions, read_image)
    top = predictions.highest_loss(GALLERY_IMAGES)
    parts = [
        f"<p class='note'>{esc(about)}</p>",
        f"<h3>The {len(top)} images with the highest loss</h3>",
        "<div class='gallery' id='gallery'>" + "".join(tiles.tile(r) for r in top) + "</div>",
    ]
    metrics = per_class_metrics(predictions.confusion(), predictions.class_names)
    index = {name: k for k, name in enumerate(predictions.class_names)}
    shown = 0
    for name in worst_first(metrics):
        rows = predictions.mistakes_of(index[name], ROW_IMAGES)
        if shown == WORST_CLASS_ROWS:
            break
        if not len(rows):
            continue
        shown += 1
        m = metrics[name]
        confused = m["most_confused_with"]
        parts.append(
            f"<h3>{esc(name)}: recall {number(m['recall'], 3)}, F1 {number(m['f1'], 3)}, "
            f"{m['images'] - m['correct']} of {m['images']} wrong"
            + (f", most often taken for {esc(confused['class'])}" if confused else "")
            + "</h3>"
        )
        parts.append("<div class='gallery row'>" + "".join(tiles.tile(r) for r in rows) + "</div>")
    if not shown:
        parts.append("<p>No class has a mistake to show.</p>")
    return Section("mistakes", "Mistakes", "\n".join(parts))


class Tiles:
    """An image's tile: its picture, true and predicted class and confidence (each picture
    read once)."""

    def __init__(self, predictions: Predictions, read_image: ImageReader):
        self.p, self.read_image = predictions, read_image
        self.pictures: dict[int, str | None] = {}

    def picture(self, row: int) -> str | None:
        if row not in self.pictures:
            image = self.read_image(self.p.locations[row]) if self.p.locations else None
            self.pictures[row] = thumbnail_uri(image) if image is not None else None
        return self.pictures[row]

    def tile(self, row: int) -> str:
        p, row = self.p, int(row)
        where = p.locations[row] if p.locations else f"image {row}"
        true, predicted = p.class_names[p.targets[row]], p.class_names[p.predicted[row]]
        uri = self.picture(row)
        picture = (
            f"<img src='{uri}' alt='{esc(where)}' title='{esc(where)}'>"
            if uri
            else f"<div class='missing' title='{esc(where)}'>not readable here</div>"
        )
        right = true == predicted
        marked = "" if right else " class='wrong'"  # a mistake: outlined in red
        return (
            f"<figure{marked}>{picture}<figcaption>"
            f"<b>{esc(true)}</b><br><span class='verdict'>{'right' if right else 'taken for'} "
            f"<b>{esc(predicted)}</b></span> ({percent(float(p.confidence[row]), 0)})<br>"
            f"loss {max(float(p.loss[row]), 0.0):.2f}</figcaption></figure>"
        )

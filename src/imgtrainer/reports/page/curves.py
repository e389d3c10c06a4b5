"""Training curves from the history file: a PNG of them, and the report page's charts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from imgtrainer.errors import UserError
from imgtrainer.reports.figures import new_figure, save_figure
from imgtrainer.reports.history import read_history
from imgtrainer.reports.page.svg_chart import Series, line_chart


def load_history(path: Path) -> dict:
    if not path.is_file():
        raise UserError(
            f"history file {path} does not exist; a training run writes it to "
            "<log_dir>/training_history.json"
        )
    try:
        history = read_history(path)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path} is not a training history file ({err})") from None
    if not history["epochs"]:
        raise UserError(f"{path} holds no finished epoch yet; nothing to plot")
    return history


def plot_curves(history: dict, output: Path) -> None:
    records = history["epochs"]
    epochs = [r["epoch"] for r in records]
    # Epochs without validation (--val_every_epochs) have no val_* points.
    validated = [r for r in records if "val_acc" in r]
    val_epochs = [r["epoch"] for r in validated]
    fig, (ax_loss, ax_acc, ax_lr) = new_figure(1, 3, figsize=(15, 4.5))
    ax_loss.plot(epochs, [r["train_loss"] for r in records], "o-", label="train")
    ax_loss.plot(val_epochs, [r["val_loss"] for r in validated], "o-", label="val")
    ax_loss.set(title="Loss", xlabel="epoch", ylabel="cross-entropy")
    ax_acc.plot(epochs, [r["train_acc"] for r in records], "o-", label="train top-1")
    ax_acc.plot(val_epochs, [r["val_acc"] for r in validated], "o-", label="val top-1")
    ax_acc.plot(val_epochs, [r["val_top5"] for r in validated], "o--", label="val top-5")
    ax_acc.set(title="Accuracy", xlabel="epoch", ylabel="accuracy", ylim=(0, 1.02))
    ax_lr.plot(epochs, [r["lr"] for r in records], "o-", color="tab:green")
    ax_lr.set(title="Learning rate (end of epoch)", xlabel="epoch", ylabel="lr")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in (ax_loss, ax_acc, ax_lr):
        ax.grid(alpha=0.3)
    ax_loss.legend()
    ax_acc.legend()
    model = (history.get("config") or {}).get("model", "model")
    best = max((r["val_acc"] for r in validated), default=None)
    fig.suptitle(
        f"{model}, world size {history.get('world_size', '?')}"
        + (f": best val top-1 {best:.4f}" if best is not None else "")
    )
    save_figure(fig, output, dpi=120)


# The report's panels: (title, y label, the fields drawn, each beside its EMA twin when present).
PANELS = [
    ("Loss", "cross-entropy", ["train_loss", "val_loss"]),
    ("Top-1 accuracy", "accuracy", ["train_acc", "val_acc"]),
    ("Top-5 accuracy", "accuracy", ["val_top5"]),
    ("Learning rate (end of epoch)", "lr", ["lr"]),
    ("Training speed", "images/s (all processes)", ["train_images_per_sec"]),
    ("Waiting for data", "share of the training time", ["data_wait_share"]),
]
SHOWN = {name for _, _, names in PANELS for name in names} | {"epoch"}
RANK_FIELD = re.compile(r"rank(\d+)_(.+)")


def series(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """(epochs, values) of the records that have a number under ``name``."""
    points = [
        (r["epoch"], float(r[name]))
        for r in records
        if isinstance(r.get(name), int | float) and not isinstance(r.get(name), bool)
    ]
    return [p[0] for p in points], [p[1] for p in points]


def report_charts(history: dict[str, Any], best_epoch: int | None) -> list[str]:
    """The report's curves (``PANELS``), one SVG chart each (they wrap on a narrow screen): raw
    and EMA weights side by side, the best epoch marked by a dashed line."""
    records = history["epochs"]
    charts = []
    for title, y_label, names in PANELS:
        fields = [f for name in names for f in (name, name + "_ema")]
        if "data_wait_share" in names:
            fields += rank_fields(records, "data_wait_share")
        lines = []
        for field in fields:
            dash = "5 3" if field.endswith("_ema") else "2 3" if field.startswith("rank") else ""
            lines.append(Series(field, *series(records, field), dash=dash))
        charts.append(line_chart(title, lines, y_label, best_epoch))
    return charts


def rank_fields(records: list[dict[str, Any]], figure: str) -> list[str]:
    """The per-rank fields (``rank<N>_<figure>``) the records hold."""
    found = {
        key for r in records for key in r if (m := RANK_FIELD.fullmatch(key)) and m[2] == figure
    }
    return sorted(found, key=lambda key: int(RANK_FIELD.fullmatch(key)[1]))


def other_fields(records: list[dict[str, Any]]) -> list[str]:
    """The numeric fields of the records not drawn by ``report_curves``, in the order they first
    appear; per-rank fields (``rank<N>_x``) as one entry ``rank*_x``."""
    found: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            if key in SHOWN or key.removesuffix("_ema") in SHOWN:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            match = RANK_FIELD.fullmatch(key)
            found[f"rank*_{match[2]}" if match else key] = None
    return [key for key in found if key != "rank*_data_wait_share"]


MAX_OTHER_PANELS = 12
# The y axis of the other charts whose fields the trainer writes (a field unknown here: none).
OTHER_LABELS = {
    "epoch_seconds": "seconds",
    "peak_memory_mb": "MB at the peak",
    "micro_batch": "images per pass",
    "audit_images": "images checked",
    "audit_max_diff": "0-255 levels",
    "rank*_step_s": "seconds per step",
}


def other_charts(history: dict[str, Any]) -> list[str]:
    """Every other numeric field of the records (the data audit's, each rank's step times,
    peak memory, what later versions add), a chart each, all ranks of a per-rank field in one."""
    records = history["epochs"]
    charts = []
    for name in other_fields(records)[:MAX_OTHER_PANELS]:
        per_rank = name.startswith("rank*_")
        fields = rank_fields(records, name[len("rank*_") :]) if per_rank else [name]
        lines = [Series(f, *series(records, f)) for f in fields]
        charts.append(line_chart(name, lines, OTHER_LABELS.get(name, "")))
    return charts

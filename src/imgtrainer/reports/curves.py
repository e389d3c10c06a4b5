"""Training curves from the history file."""

from __future__ import annotations

import json
from pathlib import Path

from imgtrainer.errors import UserError
from imgtrainer.reports.figures import new_figure, save_figure
from imgtrainer.reports.history import read_history


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
    model = history.get("config", {}).get("model", "model")
    best = max((r["val_acc"] for r in validated), default=None)
    fig.suptitle(
        f"{model}, world size {history.get('world_size', '?')}"
        + (f": best val top-1 {best:.4f}" if best is not None else "")
    )
    save_figure(fig, output, dpi=120)

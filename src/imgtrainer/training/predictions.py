"""Every image's prediction in an evaluation pass, gathered from every rank: the report's
confusion matrix, per-class table and pictures of mistakes.

A ``PredictionRecorder`` rides along the pass that computes the metrics (no pass of its own):
it keeps each micro-batch's rows on the device and copies them to the host once, at the end.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imgtrainer.distributed.collectives import all_gather_objects
from imgtrainer.reports.predictions import BEST_PREDICTIONS, Predictions

log = logging.getLogger(__name__)


class PredictionRecorder:
    """A ``PredictionHook`` (``training.evaluation.evaluate``): the true class, top-1 class, its
    probability and the loss of every image this rank evaluates, in the loader's order."""

    def __init__(self):
        self.rows: list[torch.Tensor] = []

    def __call__(
        self, logits: torch.Tensor, predicted: torch.Tensor, targets: torch.Tensor
    ) -> None:
        log_probs = logits.float().log_softmax(dim=1)
        confidence = log_probs.gather(1, predicted[:, None])[:, 0].exp()
        loss = -log_probs.gather(1, targets[:, None])[:, 0]
        # One float64 row per image: class indices stay exact up to 2**53.
        columns = (targets, predicted, confidence, loss)
        self.rows.append(torch.stack([column.double() for column in columns], dim=1))

    def gathered(self, sampler, locations, class_names: list[str]) -> Predictions:
        """Every rank's rows, in the data's order: ``sampler`` gives this rank's dataset indices
        in the order the pass saw them, ``locations(index)`` an image's location (None: no
        locations, for a rank that writes nothing). Every rank must call this (a collective);
        each gets the whole."""
        rows = torch.cat(self.rows).cpu().numpy() if self.rows else np.zeros((0, 4))
        indices = np.fromiter(iter(sampler), dtype=np.int64)
        if len(indices) != len(rows):
            raise RuntimeError(f"{len(rows)} predictions for {len(indices)} images of the sampler")
        self.rows = []
        shards = all_gather_objects((indices, rows))
        indices = np.concatenate([shard[0] for shard in shards])
        rows = np.concatenate([shard[1] for shard in shards])
        order = np.argsort(indices, kind="stable")
        indices, rows = indices[order], rows[order]
        return Predictions(
            list(class_names),
            [locations(int(i)) for i in indices] if locations is not None else [],
            rows[:, 0].astype(np.int64),
            rows[:, 1].astype(np.int64),
            rows[:, 2].astype(np.float32),
            rows[:, 3].astype(np.float32),
        )


def image_locations(dataset):
    """``location(index)`` of an evaluation dataset's images, whatever holds them (a table of
    files, a RAM or GPU cache of the table's images); "#<index>" for a dataset without one."""
    table = getattr(getattr(dataset, "images", None), "table", None)
    return table.location if table is not None else "#{}".format


class BestPredictions:
    """The validation predictions of the run's best checkpoint, written to
    ``<log_dir>/best_predictions.npz`` (by the main process) when an epoch is the new best:
    the pass that scored the epoch made them, with the weights the checkpoint keeps."""

    def __init__(self, log_dir: Path, class_names: list[str], enabled: bool):
        self.path = Path(log_dir) / BEST_PREDICTIONS
        self.class_names, self.enabled = class_names, enabled

    def recorders(self, ema_enabled: bool) -> dict[str, PredictionRecorder]:
        """A recorder per set of weights validated: "raw", and with EMA "ema"."""
        return {name: PredictionRecorder() for name in ("raw", "ema")[: 1 + ema_enabled]}

    def keep(
        self, recorders: dict[str, PredictionRecorder], loader, record: dict[str, Any], best
    ) -> None:
        """The new best epoch's (``record``) predictions of the weights that scored it
        (``best.weights``). Every rank must call this at a new best epoch."""
        recorder = recorders.get(best.weights or "raw") or recorders["raw"]
        locations = image_locations(loader.dataset) if self.enabled else None
        predictions = recorder.gathered(loader.sampler, locations, self.class_names)
        if not self.enabled:
            return
        suffix = "_ema" if best.weights == "ema" else ""
        predictions.about = {
            "epoch": record["epoch"],
            "weights": best.weights or "raw",
            "metric": best.metric,
            "value": best.value,
            "val_acc": record.get("val_acc" + suffix),
        }
        predictions.save(self.path)

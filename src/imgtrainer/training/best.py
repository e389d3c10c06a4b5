"""The best epoch by --best_metric, early stopping on it, and which epochs' checkpoints are kept.

Only validated epochs count (--val_every_epochs): an epoch without validation is neither best
nor a step of the patience, which counts validations as Lightning's ``EarlyStopping`` does. As in
Keras and Lightning, the best checkpoint follows any improvement, while early stopping waits for
one larger than --early_stopping_min_delta over its own reference value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from imgtrainer.checkpoints.resume import check_best_metric
from imgtrainer.config import BEST_METRICS, TrainConfig
from imgtrainer.distributed.collectives import all_gather_objects
from imgtrainer.training.ema import EMA_SUFFIX


def lower_is_better(metric: str) -> bool:
    return BEST_METRICS[metric] == "lower"


def metric_value(
    record: Mapping[str, Any], metric: str, ema_enabled: bool
) -> tuple[float, str] | None:
    """``metric``'s value in an epoch's history record and the weights that scored it ("raw" or
    "ema"); None for an epoch without validation. With EMA a metric without the ``_ema`` suffix
    is the better of the two weights' (ties go to the EMA, the smoother of the two)."""
    if metric.endswith(EMA_SUFFIX):
        value = record.get(metric)
        return None if value is None else (value, "ema")
    raw, ema = record.get(metric), record.get(metric + EMA_SUFFIX) if ema_enabled else None
    if raw is None:
        return None
    if ema is not None and (ema <= raw if lower_is_better(metric) else ema >= raw):
        return ema, "ema"
    return raw, "raw"


def improves(value: float, reference: float | None, metric: str, delta: float = 0.0) -> bool:
    """``value`` is better than ``reference`` by more than ``delta`` (NaN never improves)."""
    if reference is None:
        return not math.isnan(value)
    return value < reference - delta if lower_is_better(metric) else value > reference + delta


@dataclass
class BestState:
    """What a checkpoint keeps of the best epoch and of early stopping (plain values)."""

    metric: str = "val_acc"
    value: float | None = None  # the best value so far
    epoch: int | None = None  # the first epoch that scored it
    weights: str | None = None  # "raw" or "ema": the weights that scored it
    reference: float | None = None  # early stopping's best: improved by more than min_delta
    wait: int = 0  # validated epochs since ``reference`` last improved


class BestTracker:
    """The best epoch and the early-stopping count; identical on every rank (``agree``)."""

    def __init__(self, cfg: TrainConfig):
        self.ema_enabled = cfg.model_ema
        self.patience, self.min_delta = cfg.early_stopping_patience, cfg.early_stopping_min_delta
        self.keep_best, self.keep_every = cfg.keep_checkpoints, cfg.save_every_epochs
        self.state = BestState(cfg.best_metric)

    @property
    def metric(self) -> str:
        return self.state.metric

    def score(self, record: Mapping[str, Any]) -> tuple[float, str] | None:
        return metric_value(record, self.metric, self.ema_enabled)

    def update(self, record: Mapping[str, Any]) -> bool:
        """Count an epoch's record; True if it is the new best."""
        scored = self.score(record)
        if scored is None:
            return False
        value, weights = scored
        s = self.state
        if improves(value, s.reference, self.metric, self.min_delta):
            s.reference, s.wait = value, 0
        else:
            s.wait += 1
        if not improves(value, s.value, self.metric):
            return False
        s.value, s.epoch, s.weights = value, record["epoch"], weights
        return True

    def agree(self, record: Mapping[str, Any], distributed: bool) -> bool:
        """``update`` on every rank, then the main process's verdict everywhere: the ranks
        compute the same metrics, yet they stop at the same epoch whatever the floating point
        does."""
        is_best = self.update(record)
        if distributed:
            main_state, is_best = all_gather_objects((self.to_plain(), is_best))[0]
            self.state = BestState(**main_state)
        return is_best

    @property
    def should_stop(self) -> bool:
        """Early stopping: --early_stopping_patience validations without an improvement."""
        return self.patience > 0 and self.state.wait >= self.patience

    def kept_epochs(self, records: Sequence[Mapping[str, Any]]) -> set[int]:
        """The epochs whose checkpoints are kept: the --keep_checkpoints best (the earlier one of
        equal scores first) and every --save_every_epochs-th."""
        scored = [(self.score(r), r["epoch"]) for r in records]
        ranked = sorted(
            ((s[0], epoch) for s, epoch in scored if s and math.isfinite(s[0])),
            key=lambda pair: (pair[0] if lower_is_better(self.metric) else -pair[0], pair[1]),
        )
        kept = {epoch for _, epoch in ranked[: self.keep_best]}
        if self.keep_every:
            kept |= {r["epoch"] for r in records if r["epoch"] % self.keep_every == 0}
        return kept

    def last_weights(self, records: Sequence[Mapping[str, Any]]) -> str | None:
        """The weights that scored better at the last validation (None before any)."""
        scored = next((s for s in map(self.score, reversed(records)) if s), None)
        return scored[1] if scored else None

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_fields(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        s = self.state
        accuracies = (metric_value(r, "val_acc", self.ema_enabled) for r in records)
        return {
            "best_metric": s.metric,
            "best_value": s.value,
            "best_epoch": s.epoch,
            # What it meant before --best_metric, whatever that chooses: older readers use it.
            "best_acc": max((scored[0] for scored in accuracies if scored), default=0.0),
            "early_stopping": {"reference": s.reference, "wait": s.wait},
        }

    def resume(self, checkpoint: Mapping[str, Any], path: Path, override: bool) -> None:
        """Continue the checkpoint's best and patience count. A checkpoint from before
        --best_metric, or (under --resume_override) of another metric, is replayed from its
        history instead."""
        check_best_metric(checkpoint, path, self.metric, override)
        if checkpoint.get("best_metric") == self.metric:
            stopping = checkpoint.get("early_stopping") or {}
            self.state = BestState(
                self.metric,
                checkpoint.get("best_value"),
                checkpoint.get("best_epoch"),
                None,
                stopping.get("reference"),
                int(stopping.get("wait", 0)),
            )
            records = checkpoint.get("history") or []
            best = next((r for r in records if r.get("epoch") == self.state.epoch), None)
            scored = self.score(best) if best else None
            self.state.weights = scored[1] if scored else None
            return
        self.state = BestState(self.metric)
        for record in checkpoint.get("history") or []:
            self.update(record)

    def to_plain(self) -> dict[str, Any]:
        return asdict(self.state)

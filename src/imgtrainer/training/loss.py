"""The training loss: cross-entropy with label smoothing, and with ``--class_weights balanced`` a
weight per class (``data.balance.balanced_class_weights``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from imgtrainer.config import TrainConfig
from imgtrainer.data import balanced_class_weights


class ClassWeightedCrossEntropy(nn.Module):
    """Cross-entropy whose per-sample loss is weighted by class, averaged over the samples
    (Keras's ``class_weight``; PyTorch's own weighted mean divides by the batch's weights
    instead, for class indices only).

    A sample's loss is sum_c w_c y_c (-log p_c) over its target distribution y: w_label x CE
    for a label, lam w_a CE_a + (1 - lam) w_b CE_b for a mixup/cutmix pair, and label smoothing
    spreads its share over the classes with their weights, as for class indices. Dividing by
    the number of samples, not by the weights, keeps the loss of a batch the same whether it is
    split into micro-batches or over processes, and with or without mixing.
    """

    def __init__(self, weight: torch.Tensor, label_smoothing: float = 0.0):
        super().__init__()
        self.register_buffer("weight", weight.float())
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits,
            targets,
            weight=self.weight,
            label_smoothing=self.label_smoothing,
            reduction="none",
        ).mean()


def build_criterion(cfg: TrainConfig, class_counts: Sequence[int] | None) -> nn.Module:
    """The run's training loss; ``class_counts`` (images per class) for --class_weights."""
    if cfg.class_weights == "none":
        return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    if class_counts is None:
        raise ValueError("--class_weights balanced needs the training images per class")
    weights = torch.tensor(balanced_class_weights(class_counts))
    return ClassWeightedCrossEntropy(weights, cfg.label_smoothing)

"""Scoring a checkpoint on a set of images: every image's prediction, gathered from every rank.

The images of any layout (a folder may hold only some of the checkpoint's classes), each seen
as the checkpoint's training evaluated it, by exactly one rank.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from imgtrainer.data import FOLDER, layout_of, open_table
from imgtrainer.data.host.samplers import ShardSampler
from imgtrainer.data.host.samples import SeededImageDataset
from imgtrainer.data.layouts.decode_check import leave_out_unreadable
from imgtrainer.data.layouts.folder_checks import find_classes
from imgtrainer.data.layouts.table import TableImages
from imgtrainer.data.loaders import LoaderSpec, loader_workers, make_loader
from imgtrainer.distributed.setup import DistInfo, cpu_cores_available
from imgtrainer.errors import UserError
from imgtrainer.reports.predictions import Predictions
from imgtrainer.tools.inference import Classifier
from imgtrainer.training.evaluation import EvalSettings, evaluation_sums
from imgtrainer.training.predictions import PredictionRecorder, image_locations
from imgtrainer.training.step import LOSS, TOP5

log = logging.getLogger(__name__)


@dataclass
class EvalCounts:
    """Everything the report needs, summed (or gathered) over all ranks."""

    predictions: Predictions  # every image's, in the data's order
    loss_sum: float
    top5_correct: int

    @cached_property
    def confusion(self) -> np.ndarray:
        """[K, K] int64, rows true, columns predicted."""
        return self.predictions.confusion()

    @property
    def misclassified(self) -> list[tuple[int, int, float]]:
        """(dataset index, predicted class, confidence) of every mistake, in the data's order."""
        p = self.predictions
        rows = np.flatnonzero(~p.correct)
        return [(int(i), int(p.predicted[i]), float(p.confidence[i])) for i in rows]

    @property
    def images(self) -> int:
        return int(self.confusion.sum())


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


def count_predictions(
    classifier: Classifier, loader, device: torch.device, show_progress: bool = True
) -> EvalCounts:
    """Every image's prediction, loss and top-5 over this rank's shard, gathered and summed over
    all ranks. Every rank must call this (it ends with collectives).

    The pass is training's own (``training.evaluation.evaluation_sums``: its autocast,
    micro-batch and layout, read from the checkpoint), so top-1 is the ``val_acc`` training
    recorded for the same checkpoint and images. ShardSampler gives each image to exactly one
    rank.
    """
    recorder = PredictionRecorder()
    settings = EvalSettings(device, classifier.precision, classifier.plan, show_progress)
    sums = evaluation_sums(classifier.model, loader, settings, on_predictions=recorder).tolist()
    locations = image_locations(loader.dataset)
    predictions = recorder.gathered(loader.sampler, locations, classifier.class_names)
    return EvalCounts(predictions, sums[LOSS], int(sums[TOP5]))


def eval_loader(classifier: Classifier, folder: TableImages, args: argparse.Namespace, dist):
    """The images of ``folder`` as ``classifier`` was trained to see them, each image on one
    rank (``ShardSampler``): the same indices for any checkpoint."""
    dataset = SeededImageDataset(folder, classifier.transform, seed=0)
    workers = loader_workers(
        args.num_workers, cpu_cores_available() // dist.local_world_size, dist.device.type
    )
    return make_loader(
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


def score(
    classifier: Classifier, folder: TableImages, args: argparse.Namespace, dist: DistInfo
) -> EvalCounts:
    """``count_predictions`` of ``classifier`` on ``folder``, with its log line."""
    log.info(
        f"Evaluating {classifier.path} on {len(folder)} images of {args.data_dir} "
        f"({dist.world_size} process(es) on {dist.device.type}) with {classifier.weights_note}; "
        f"resize ratio {classifier.eval_resize_ratio}, test-time augmentation: {classifier.tta}"
    )
    loader = eval_loader(classifier, folder, args, dist)
    return count_predictions(classifier, loader, dist.device, show_progress=dist.is_main)

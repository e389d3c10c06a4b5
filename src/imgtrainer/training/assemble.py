"""A run's parts, built in one place from the config and handed whole to the ``Trainer``.

``assemble`` reads top-down like torchvision's ``main()``: the checkpoint to resume, the data,
the model and its optimisation, the EMA, the memory plan (which completes the training
batches), then the run's records, stops and checkpoints.
"""

from __future__ import annotations

import platform
import socket
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import timm
import torch
import torchvision

from imgtrainer import redact
from imgtrainer.checkpoints.writer import CheckpointWriter, checkpoint_writer
from imgtrainer.config import Layout, TrainConfig, parse_duration
from imgtrainer.data import Loaders, open_data
from imgtrainer.distributed.collectives import all_gather_objects
from imgtrainer.distributed.setup import DistInfo
from imgtrainer.errors import UserError
from imgtrainer.events import EventLog
from imgtrainer.hooks import Hook
from imgtrainer.reports.history import HistoryWriter
from imgtrainer.reports.trackers import TrackerContext, build_trackers
from imgtrainer.training.best import BestTracker
from imgtrainer.training.build import build_run_parts
from imgtrainer.training.ema import ModelEma
from imgtrainer.training.memory_fit import TrialParts, build_memory_plan
from imgtrainer.training.nonfinite import NonFiniteLoss
from imgtrainer.training.optim import restore_optimizer_state, restore_scheduler_state
from imgtrainer.training.periodic import SaveSchedule
from imgtrainer.training.predictions import BestPredictions
from imgtrainer.training.run_state import ResumeSource, RunState, find_resume
from imgtrainer.training.step import RunParts
from imgtrainer.training.stopping import StopRequest, TimeBudget
from imgtrainer.training.stragglers import StragglerWatch


@dataclass
class Assembly:
    """Everything a run trains with, each part built once by ``assemble``."""

    cfg: TrainConfig  # laid out for this world size
    requested: TrainConfig  # the flags as given: checkpoints keep them
    dist: DistInfo
    budget: TimeBudget  # --max_time, counted from the start of the assembly
    resume_from: ResumeSource
    loaders: Loaders
    parts: RunParts
    ema: ModelEma
    best: BestTracker  # --best_metric, early stopping, the kept epochs
    history: HistoryWriter
    run_state: RunState  # what a checkpoint holds of the run
    checkpoints: CheckpointWriter
    saves: SaveSchedule  # --save_every_steps, --save_every_minutes
    stop: StopRequest
    stragglers: StragglerWatch | None  # every rank's host clocks (none on one process)
    nonfinite: NonFiniteLoss
    best_predictions: BestPredictions  # the best epoch's validation predictions, for the report


def assemble(cfg: TrainConfig, dist: DistInfo, events: EventLog | None = None) -> Assembly:
    """The parts of the run of ``cfg``; its history keeps ``events`` (the main process's).
    Every rank must call this."""
    requested = cfg
    budget = TimeBudget(parse_duration(cfg.max_time) if cfg.max_time else None)
    resume_from, cfg = find_resume(cfg, dist)  # the layout that keeps a resumed global batch
    data = open_data(cfg, dist)
    names, counts = data.class_names, data.class_counts
    parts = build_run_parts(cfg, dist, len(names), data.steps_per_epoch, counts)
    # Built before the memory plan, so --auto_micro_batch's trials see its memory in use.
    ema = ModelEma(parts.plain_model if cfg.model_ema else None, cfg.ema_decay)
    # The micro-batch; with --auto_micro_batch found by trials (every rank takes part).
    parts.plan = build_memory_plan(
        cfg, TrialParts.of(parts), dist.processes_on_device, len(names), data.source
    )
    # The augmentation runs before the step, in the plan's chunks, retried like the step.
    loaders = data.loaders(parts.plan.augment_chunk, parts.plan.retry_on_oom)
    best = BestTracker(cfg)
    history = HistoryWriter(
        Path(cfg.log_dir) / "training_history.json",
        run_header(cfg, dist, names, parts, counts),
        enabled=dist.is_main,
        live=lambda: {"best": best.to_plain()},
        events=events,
    )
    # The same run: its earlier starts' events stay.
    history.open_events(continues=resume_from.path is not None or not dist.first_attempt)
    load = partial(load_optimisation, parts)
    run_state = RunState(parts, ema, best, history, names, cfg, requested, load)
    stragglers = (
        StragglerWatch(all_gather_objects(socket.gethostname())) if dist.is_distributed else None
    )
    return Assembly(
        cfg=cfg,
        requested=requested,
        dist=dist,
        budget=budget,
        resume_from=resume_from,
        loaders=loaders,
        parts=parts,
        ema=ema,
        best=best,
        history=history,
        run_state=run_state,
        checkpoints=checkpoint_writer(cfg, dist.is_main),
        saves=SaveSchedule(cfg.save_every_steps, cfg.save_every_minutes * 60),
        stop=StopRequest(dist.is_distributed, stragglers),
        stragglers=stragglers,
        nonfinite=NonFiniteLoss(dist.device, dist.is_distributed),
        best_predictions=BestPredictions(Path(cfg.log_dir), names, dist.is_main),
    )


def run_header(
    cfg: TrainConfig, dist: DistInfo, class_names: list[str], parts, class_counts: list[int]
) -> dict[str, Any]:
    """The history file's head: what the run is, on what, with which data (the report's)."""
    return {
        "config": cfg.to_dict(),
        "world_size": dist.world_size,
        "effective_batch_size": Layout.of(cfg, dist.world_size).global_batch,
        "device": str(dist.device.type),
        "class_names": class_names,
        "train_class_counts": class_counts,
        "command": [redact.text(arg) for arg in sys.argv],
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "timm": timm.__version__,
        },
        "environment": environment(dist, parts.precision),
    }


def environment(dist: DistInfo, precision) -> dict[str, Any]:
    """The main process's host, its GPUs and CUDA, and the precision of the forward pass."""
    cuda = dist.device.type == "cuda"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "host": socket.gethostname(),
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpus": gpus,
        "precision": f"{str(precision.dtype).removeprefix('torch.')} autocast"
        if precision.enabled
        else "float32",
    }


def load_optimisation(parts: RunParts, ckpt: dict[str, Any], regroup: bool) -> None:
    """The optimizer's and scheduler's saved states into ``parts`` (``restore``'s hand)."""
    restore_optimizer_state(
        parts.optimizer, ckpt["optimizer_state_dict"], parts.plain_model, regroup=regroup
    )
    restore_scheduler_state(parts.scheduler, ckpt["scheduler_state_dict"])


def main_process_trackers(cfg: TrainConfig, dist: DistInfo, context: TrackerContext) -> list[Hook]:
    """TensorBoard and --log_to's trackers, on the main process; a missing package or a
    refused login there stops every rank with its line."""
    trackers, error = [], None
    if dist.is_main:
        try:
            trackers = build_trackers(cfg.log_to, context, tensorboard=cfg.tensorboard)
        except UserError as err:
            error = str(err)
    error = all_gather_objects(error)[0]
    if error is not None:
        raise UserError(error)
    return trackers

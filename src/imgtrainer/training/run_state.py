"""What a training checkpoint holds of a run, and how a resume puts it back.

``checkpoint_state`` makes it; ``find_resume`` finds it, then ``restore`` puts it back once the
run's parts are built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from imgtrainer.checkpoints.files import (
    CheckpointError,
    load_training_checkpoint,
    previous_path,
    training_checkpoint,
)
from imgtrainer.checkpoints.remote import (
    DOWNLOADED,
    checkpoint_folder,
    checkpoint_store,
    fetch_latest,
)
from imgtrainer.checkpoints.resume import (
    apply_optimisation_settings,
    check_resume_fits,
    check_resume_settings,
    find_resume_checkpoint,
    optimisation_settings,
    requested_global_batch,
    restore_rank_state,
    saved_global_batch,
    saved_world_size,
)
from imgtrainer.checkpoints.run_folder import LATEST_NAME
from imgtrainer.config import Layout, TrainConfig, choose_layout
from imgtrainer.data import IMAGENET_MEAN, IMAGENET_STD
from imgtrainer.distributed.collectives import all_gather_objects, barrier
from imgtrainer.distributed.setup import DistInfo
from imgtrainer.errors import UserError
from imgtrainer.events import event
from imgtrainer.reports.history import HistoryWriter, best_line
from imgtrainer.storage import is_url
from imgtrainer.training.best import BestTracker
from imgtrainer.training.ema import ModelEma
from imgtrainer.training.step import RunParts

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the run is: the epoch in progress (0-based) and the optimizer steps done in it."""

    epoch: int = 0
    step: int = 0

    def position(self, global_batch: int) -> int:
        """Samples of the epoch's global order consumed: a resume on any number of processes
        continues there."""
        return self.step * global_batch


@dataclass(frozen=True)
class ResumeSource:
    """The checkpoint a run continues (none for a new run) and the flags --resume_override
    changes."""

    path: Path | None = None
    state: dict[str, Any] | None = None
    changes: list[str] = field(default_factory=list)


@dataclass
class RunState:
    """The run's objects that a checkpoint holds (the trainer's)."""

    parts: RunParts
    ema: ModelEma
    best: BestTracker
    history: HistoryWriter
    class_names: list[str]
    cfg: TrainConfig  # laid out for this world size
    requested: TrainConfig  # the flags as given: a restart compares its own with them
    # Loads the optimizer's and scheduler's states (``training.optim``, a floor above):
    # (checkpoint, regroup under --resume_override).
    load_optimisation: Callable[[dict[str, Any], bool], None]


def find_resume(cfg: TrainConfig, dist: DistInfo) -> tuple[ResumeSource, TrainConfig]:
    """The checkpoint to resume, and ``cfg`` with the --batch_size and --accum_steps that make
    its global batch on this run's processes (unchanged when the run's own flags make it).
    Workers that torchrun restarted continue from the newest checkpoint, as under --resume
    auto. A resume whose flags change the run is refused here unless --resume_override."""
    folder, path, world = checkpoint_folder(cfg), None, dist.world_size
    if is_url(cfg.checkpoint_dir) and (cfg.resume == "auto" or not dist.first_attempt):
        take_newest_checkpoint(cfg, dist)
    if not dist.first_attempt:
        path = find_resume_checkpoint("auto", folder)
    path = path or find_resume_checkpoint(cfg.resume, folder)
    if path is None:
        return ResumeSource(), cfg
    state = load_training_checkpoint(path)
    # Model and optimizer first (the classes are compared once the data is read).
    check_resume_fits(state, path, state.get("class_names"), cfg.model, cfg.optimizer)
    changes = check_resume_settings(state, path, cfg.to_dict(), world, override=cfg.resume_override)
    source = ResumeSource(path, state, changes)
    target, _ = requested_global_batch(state, cfg.to_dict(), world)
    if target == Layout.of(cfg, world).global_batch:
        return source, cfg
    layout = choose_layout(target, world, cfg.batch_size)
    return source, replace(cfg, batch_size=layout.batch_size, accum_steps=layout.accum_steps)


def take_newest_checkpoint(cfg: TrainConfig, dist: DistInfo) -> None:
    """Before a resume from a --checkpoint_dir in a store: the newer of the store's newest
    checkpoint and the local copy's, by their position in training, as the local latest (a
    restart after an upload that did not finish must not go back). One process per node
    downloads and decides; every rank must call this."""
    if dist.local_rank == 0:
        local = checkpoint_folder(cfg)
        url = fetch_latest(cfg.checkpoint_dir, checkpoint_store(cfg), local)
        if url is not None:
            settle_newest(local, url)
    barrier()


def settle_newest(local: Path, url: str) -> None:
    """The store's checkpoint (downloaded from ``url`` to ``local/DOWNLOADED``) as the local
    latest if it is further in training than the local one; one line says which is taken."""
    fetched, latest = local / DOWNLOADED, local / LATEST_NAME
    theirs, mine = training_position(fetched), training_position(latest)
    if mine is not None and (theirs is None or mine >= theirs):
        fetched.unlink()
        taken, other = f"the local {latest} ({where(mine)})", f"{url} ({where(theirs)})"
    else:
        os.replace(fetched, latest)
        taken, other = f"{url} ({where(theirs)})", f"the local copy ({where(mine)})"
    log.info(f"Resume: {taken} is the newest checkpoint, not {other}")


def where(position: tuple[int, int] | None) -> str:
    return "none" if position is None else f"epoch {position[0] + 1}, sample {position[1]}"


def training_position(path: Path) -> tuple[int, int] | None:
    """(epoch, samples of its order consumed) of a checkpoint (or the copy it replaced, if it is
    damaged); None when there is none to resume."""
    if not path.is_file() and not previous_path(path).is_file():
        return None
    try:
        state = load_training_checkpoint(path)
    except CheckpointError:
        return None
    return int(state["epoch"]), resumed_position(state)


def restore(
    source: ResumeSource, run: RunState, dist: DistInfo, layout: Layout, steps_per_epoch: int
) -> tuple[Progress, torch.Tensor | None]:
    """Put the checkpoint into the run's objects; the position it continues from and this
    rank's running metrics of that epoch. Every rank must call this, resuming or not."""
    progress, sums = Progress(), None
    if source.state is not None:
        progress, sums = _load(source, run, dist, layout)
        position, before = progress.position(layout.global_batch), saved_world_size(source.state)
        resumed = event(
            "resume",
            by="user" if dist.first_attempt else "torchrun",
            checkpoint=str(source.path),
            epoch=progress.epoch + 1,
            step=progress.step,
            position=position,
            world_size_before=before,
            world_size=dist.world_size,
            layout=dataclasses.asdict(layout),
        )
        log.info(
            f"Resumed from {source.path}: epoch {progress.epoch + 1}, step {progress.step} of "
            f"{steps_per_epoch} (sample {position} of the epoch's order), "
            f"{best_line(run.best.state)}; processes {before or '?'} -> {dist.world_size}, "
            f"layout {layout.describe()}",
            extra=resumed,
        )
    # Only rank 0 writes checkpoints: a rank on another node that finds none (or another
    # one) would train other weights from another position, and hang at the epoch's end.
    positions = all_gather_objects((progress.epoch, progress.step))
    if len(set(positions)) > 1:
        raise UserError(
            f"the processes resume from different positions (epoch, step) "
            f"{positions}: --checkpoint_dir must be one folder that every node "
            "sees (a shared file system), or give --resume PATH on every node"
        )
    return progress, sums


def _load(
    source: ResumeSource, run: RunState, dist: DistInfo, layout: Layout
) -> tuple[Progress, torch.Tensor | None]:
    ckpt, path, parts, cfg = source.state, source.path, run.parts, run.cfg
    check_resume_fits(ckpt, path, run.class_names, cfg.model, cfg.optimizer)
    from_flags = optimisation_settings(parts.optimizer, parts.scheduler)
    parts.plain_model.load_state_dict(ckpt["model_state_dict"])
    run.ema.resume(ckpt)
    # Param groups laid out otherwise (the flags that choose them changed) are matched by
    # name only under --resume_override.
    run.load_optimisation(ckpt, bool(source.changes))
    if source.changes:  # --resume_override: the new values, over the loaded moments and steps
        apply_optimisation_settings(parts.optimizer, parts.scheduler, from_flags)
        log.info(
            f"--resume_override: applied {'; '.join(source.changes)}; learning rate now "
            f"{parts.optimizer.param_groups[0]['lr']:.3g}"
        )
    if ckpt.get("scaler_state_dict"):
        parts.scaler.load_state_dict(ckpt["scaler_state_dict"])
    progress = Progress(ckpt["epoch"], resumed_position(ckpt) // layout.global_batch)
    run.best.resume(ckpt, path, override=cfg.resume_override)
    # A micro-batch halved after an out-of-memory error stays halved.
    parts.plan.micro_batch = min(
        parts.plan.micro_batch, ckpt.get("micro_batch", parts.plan.micro_batch)
    )
    # The checkpoint's own history: records written after it (by the run that crashed)
    # are dropped, so every epoch appears exactly once.
    run.history.records = list(ckpt.get("history", []))
    run.history.save()
    return progress, resumed_rank_state(ckpt, dist, progress.step)


def resumed_position(ckpt: dict[str, Any]) -> int:
    """Samples of the epoch's global order consumed (older checkpoints count steps)."""
    if "epoch_position" in ckpt:
        return ckpt["epoch_position"]
    return ckpt.get("step", 0) * (saved_global_batch(ckpt) or 0)


def resumed_rank_state(ckpt: dict[str, Any], dist: DistInfo, step: int) -> torch.Tensor | None:
    """This rank's random state and running metrics. Written by another number of
    processes, the metrics of the epoch's steps so far go to rank 0, as one sum (the epoch's
    figures are summed over ranks); the random streams are each rank's own, and nothing of
    the training draws from them (augmentation and mixing are seeded by position)."""
    rank_states = ckpt.get("rank_states") or []
    if len(rank_states) == dist.world_size:
        return restore_rank_state(rank_states[dist.rank], dist.device)
    sums = [s["train_sums"] for s in rank_states if s.get("train_sums") is not None]
    if not sums or not step or dist.rank != 0:
        return None
    return torch.stack(sums).sum(0)


def checkpoint_state(
    run: RunState, progress: Progress, layout: Layout, rank_states: list[dict[str, Any]]
) -> dict[str, Any]:
    """The checkpoint of the run at ``progress``, with every rank's ``rank_states``."""
    parts, records = run.parts, run.history.records
    weights = parts.plain_model.state_dict()
    ema_weights = run.ema.state_dict()
    return training_checkpoint(
        model_state_dict=weights,
        state_dict=weights,  # timm's key; the same dict, stored once
        model_ema_state_dict=ema_weights,
        state_dict_ema=ema_weights,  # timm's key; the same dict, stored once
        ema_updates=run.ema.updates if run.ema.enabled else None,
        best_weights=run.best.last_weights(records),
        optimizer_state_dict=parts.optimizer.state_dict(),
        scheduler_state_dict=parts.scheduler.state_dict(),
        scaler_state_dict=parts.scaler.state_dict() if parts.scaler.is_enabled() else None,
        epoch=progress.epoch,
        step=progress.step,
        epoch_position=progress.position(layout.global_batch),
        layout=dataclasses.asdict(layout),
        micro_batch=parts.plan.micro_batch,
        **run.best.checkpoint_fields(records),
        class_names=run.class_names,
        image_size=run.cfg.image_size,
        mean=list(IMAGENET_MEAN),
        std=list(IMAGENET_STD),
        model_name=run.cfg.model,
        config=run.requested.to_dict(),
        world_size=layout.world_size,
        effective_batch_size=layout.global_batch,
        history=records,
        rank_states=rank_states,
    )

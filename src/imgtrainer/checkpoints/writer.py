"""Writes the latest and best checkpoints of a run, and keeps the epochs' checkpoints asked for."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from imgtrainer.checkpoints.files import atomic_save, previous_path
from imgtrainer.checkpoints.remote import (
    CheckpointMirror,
    Upload,
    checkpoint_folder,
    checkpoint_store,
)
from imgtrainer.checkpoints.run_folder import (
    BEST_NAME,
    LATEST_NAME,
    epoch_checkpoint_name,
    epoch_checkpoints,
)
from imgtrainer.config import TrainConfig
from imgtrainer.distributed.collectives import all_gather_objects
from imgtrainer.errors import RunFailed, UserError
from imgtrainer.files import atomic_link
from imgtrainer.storage import is_url

CAUSES = (
    "Usual causes: a learning rate too high for this batch and optimizer "
    "(--learning_rate, --warmup_epochs), or float16 overflow under --use_amp (try "
    "--amp_dtype bfloat16 or --clip_grad_norm)"
)


def nonfinite_tensors(state_dict: Mapping[str, object]) -> list[str]:
    """Names of the floating-point tensors of ``state_dict`` holding a NaN or inf (one host
    synchronisation for all of them)."""
    named = [
        (name, t)
        for name, t in state_dict.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu()
    return [name for (name, _), ok in zip(named, finite.tolist(), strict=True) if not ok]


def nonfinite_weights_error(where: str, names: list[str]) -> RunFailed:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return RunFailed(
        f"the {where} hold NaN or inf ({shown}): the training diverged; stopped before "
        f"saving them. {CAUSES}; --resume auto continues from the last checkpoint saved "
        "before it, if any"
    )


log = logging.getLogger(__name__)

# The weights a checkpoint holds, and what the error line calls them.
WEIGHT_KEYS = {"model_state_dict": "weights", "model_ema_state_dict": "EMA weights"}


class CheckpointWriter:
    """Writes latest/best checkpoints; a no-op on every process but the main one.

    With ``replace_previous_run`` (``--overwrite``) the earlier run's checkpoints are removed at
    this run's first save, not before: a run that fails at start-up leaves them as they were.
    """

    def __init__(
        self,
        checkpoint_dir: Path,
        enabled: bool,
        replace_previous_run: bool = False,
        mirror: CheckpointMirror | None = None,
    ):
        self.dir = checkpoint_dir
        self.enabled = enabled
        self.replace_previous_run = replace_previous_run
        # --checkpoint_dir in object storage: ``dir`` is its local copy, uploaded from there.
        self.mirror = mirror
        self.upload: Upload | None = None

    @property
    def latest(self) -> Path:
        return self.dir / LATEST_NAME

    @property
    def best(self) -> Path:
        return self.dir / BEST_NAME

    def save(
        self, state: dict[str, Any], is_best: bool, keep_epochs: Collection[int] | None = None
    ) -> None:
        """Write ``state`` as the latest checkpoint (and the best one); at an epoch's end,
        ``keep_epochs``: the epochs whose checkpoints to keep (``keep``). Raises ``RunFailed``
        (writing nothing) when the weights are not finite."""
        if not self.enabled:
            return
        for key, what in WEIGHT_KEYS.items():
            bad = nonfinite_tensors(state.get(key) or {})
            if bad:
                raise nonfinite_weights_error(what, bad)
        atomic_save(state, self.latest, keep_previous=not self.replace_previous_run)
        if self.mirror is not None:
            self.upload = Upload(self.mirror.snapshot(self.latest))
            self.upload.replace_previous_run = self.replace_previous_run
            self.upload.copies += [BEST_NAME] if is_best else []
        if self.replace_previous_run:
            # The earlier run's best, fallback and kept epochs must not pass for this run's.
            # Removed once this run's latest is written, so a failed first save leaves the
            # earlier run whole.
            for old in (
                self.best,
                previous_path(self.latest),
                *epoch_checkpoints(self.dir).values(),
            ):
                old.unlink(missing_ok=True)
            self.replace_previous_run = False
        # The best checkpoint is the latest one, a second name of its file (no second write of
        # the whole checkpoint); a copy where hard links are not supported.
        if is_best and not atomic_link(self.latest, self.best):
            atomic_save(state, self.best)
        if keep_epochs is not None:
            self.keep(state, keep_epochs)

    def save_with_history(
        self,
        state: dict[str, Any],
        history: Any,
        is_best: bool,
        keep_epochs: Collection[int] | None,
    ) -> None:
        """``save``, then ``history`` (``reports.history.HistoryWriter``). Every rank must call
        this: a failure on the main process (a full disk, non-finite weights) stops every rank
        with its line, instead of leaving them waiting at the next collective."""
        error = None
        try:
            # The checkpoint first: a resume rebuilds the history from it, so a failure between
            # the two loses nothing.
            self.save(state, is_best, keep_epochs)
            history.save()
            if self.upload is not None:  # in the background: training waits for none of it
                self.upload.records = self.mirror.records()
                self.mirror.submit(self.upload)
                self.upload = None
        except (UserError, RunFailed) as err:
            error = (isinstance(err, RunFailed), str(err))
        error = all_gather_objects(error)[0]
        if error is not None:
            failed, line = error
            raise RunFailed(line) if failed else UserError(line)

    def keep(self, state: dict[str, Any], epochs: Collection[int]) -> None:
        """checkpoint_epoch_NNN.pth for this epoch if it is among ``epochs`` (a second name of
        the latest checkpoint, just written), then removes the kept checkpoints of the earlier
        epochs that no longer are. Those of later epochs (left by a run that went further before
        this one resumed from an earlier checkpoint) wait until this run reaches their epoch."""
        epoch = state["epoch"]
        if epoch in epochs:
            path = self.dir / epoch_checkpoint_name(epoch)
            if not atomic_link(self.latest, path):
                atomic_save(state, path)
            if self.upload is not None:
                self.upload.copies.append(path.name)
        for old_epoch, path in epoch_checkpoints(self.dir).items():
            if old_epoch <= epoch and old_epoch not in epochs:
                path.unlink(missing_ok=True)
                if self.upload is not None:
                    self.upload.removals.append(path.name)

    def finish(self) -> None:
        """Wait for the uploads to object storage (none for a local folder)."""
        if self.mirror is not None and self.enabled:
            self.mirror.close()


def checkpoint_writer(cfg: TrainConfig, is_main: bool) -> CheckpointWriter:
    """The run's writer: into --checkpoint_dir, or for a URL into its local copy, uploaded
    from there in the background (``CheckpointMirror``)."""
    local, mirror = checkpoint_folder(cfg), None
    if is_url(cfg.checkpoint_dir):
        store = checkpoint_store(cfg)
        mirror = CheckpointMirror(cfg.checkpoint_dir, local, Path(cfg.log_dir), store, is_main)
    return CheckpointWriter(local, is_main, cfg.overwrite, mirror)

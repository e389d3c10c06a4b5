"""Writes the latest and best checkpoints of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from imgtrainer.checkpoints.files import BEST, LATEST, atomic_save, previous_path
from imgtrainer.files import atomic_link


class CheckpointWriter:
    """Writes latest/best checkpoints; a no-op on every process but the main one.

    With ``replace_previous_run`` (``--overwrite``) the earlier run's checkpoints are removed at
    this run's first save, not before: a run that fails at start-up leaves them as they were.
    """

    def __init__(self, checkpoint_dir: Path, enabled: bool, replace_previous_run: bool = False):
        self.dir = checkpoint_dir
        self.enabled = enabled
        self.replace_previous_run = replace_previous_run

    @property
    def latest(self) -> Path:
        return self.dir / LATEST

    @property
    def best(self) -> Path:
        return self.dir / BEST

    def save(self, state: dict[str, Any], is_best: bool) -> None:
        if not self.enabled:
            return
        atomic_save(state, self.latest, keep_previous=not self.replace_previous_run)
        if self.replace_previous_run:
            # The earlier run's best and fallback must not pass for this run's. Removed once this
            # run's latest is written, so a failed first save leaves the earlier run whole.
            for old in (self.best, previous_path(self.latest)):
                old.unlink(missing_ok=True)
            self.replace_previous_run = False
        # The best checkpoint is the latest one, a second name of its file (no second write of
        # the whole checkpoint); a copy where hard links are not supported.
        if is_best and not atomic_link(self.latest, self.best):
            atomic_save(state, self.best)

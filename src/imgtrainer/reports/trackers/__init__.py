"""Experiment trackers: TensorBoard (``--tensorboard``) and ``--log_to wandb,mlflow``.

Each tracker is one module here holding a ``Tracker`` class, a ``hooks.Hook`` built
with a ``TrackerContext`` on the main process only. Its package is imported when the run asks
for it, never otherwise; a missing package, or one that refuses to start (no credentials), is
one ``UserError`` line. ``metrics.csv`` is not a tracker: the history writes it with every
checkpoint (``csv_file``).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgtrainer.config import TRACKERS, TrainConfig, tracker_names
from imgtrainer.errors import UserError
from imgtrainer.files import atomic_write

log = logging.getLogger(__name__)

# Each tracker's run id, so a resumed run continues the same tracked run.
RUN_IDS_FILE = "tracker_runs.json"


@dataclass(frozen=True)
class TrackerContext:
    """What a tracker needs from the run (the trainer builds it after resuming)."""

    cfg: TrainConfig
    log_dir: Path
    start_step: int  # the run's global step at its start: 0 for a new run
    steps_per_epoch: int
    global_step: Callable[[], int] | None = None  # the run's global step now
    # The first training images of epoch 1, augmented as in training: (images, mean, std)
    augmented_images: Callable[[], tuple[Any, Any, Any]] | None = None

    @property
    def resumed(self) -> bool:
        return self.start_step > 0

    def saved_run_id(self, tracker: str) -> str | None:
        """The id this tracker's run had before a resume, if it was kept."""
        if not self.resumed:
            return None
        try:
            return json.loads((self.log_dir / RUN_IDS_FILE).read_text()).get(tracker)
        except (OSError, ValueError, AttributeError):
            return None

    def save_run_id(self, tracker: str, run_id: str) -> None:
        path = self.log_dir / RUN_IDS_FILE
        try:
            ids = json.loads(path.read_text())
        except (OSError, ValueError):
            ids = {}
        text = json.dumps({**ids, tracker: run_id}, indent=2).encode()
        atomic_write(path, lambda f: f.write(text), lambda: len(text))


def import_package(tracker: str, install: str):
    """The tracker's own package, imported now; a missing one is one line."""
    try:
        return importlib.import_module(tracker)
    except ImportError as err:
        raise UserError(
            f"--log_to {tracker} needs the {tracker} package, which cannot be imported "
            f"({err}): {install}, or leave {tracker} out of --log_to"
        ) from None


# TensorBoard's module: on by --tensorboard, not named in --log_to.
TENSORBOARD = "tensorboard_tracker"


def build_trackers(log_to: str, context: TrackerContext, tensorboard: bool = False) -> list:
    """TensorBoard if ``tensorboard``, then the trackers ``log_to`` names, each imported (with
    its package) only now."""
    trackers = [_tracker(TENSORBOARD, context)] if tensorboard else []
    for name in tracker_names(log_to):
        trackers.append(_tracker(TRACKERS[name], context))
        log.info(f"--log_to {name}: {trackers[-1].where}")
    return trackers


def _tracker(module: str, context: TrackerContext):
    return importlib.import_module(f"{__name__}.{module}").Tracker(context)


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a history record (trackers take metrics only)."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }

"""TensorBoard event files for one run (``<log_dir>/tensorboard/``), written without a device sync.

Per-step and per-epoch curves, hyper-parameters and a grid of augmented images, by the main
process only (a no-op object elsewhere), from Python numbers only: it never waits for the GPU.

Every series is written at the global optimizer step, so a resumed run purges what a crashed run
wrote after its checkpoint in every series; since TensorBoard's Rust data server ignores the
purge marker, the logger also truncates the event files themselves (``truncate_event_files``).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from imgtrainer import torch_compat
from imgtrainer.files import atomic_write

log = logging.getLogger(__name__)


SUBDIR = "tensorboard"


# The background writer flushes at least this often, so a run killed without warning loses at
# most these seconds of curves (logging steps, epoch ends and close() flush at once).
FLUSH_SECS = 10


# Events queued before an add_* call writes them itself; large enough that it stays the
# background thread's job at the usual logging rates.
MAX_QUEUE = 100


class TensorBoardLogger:
    """Writes ``<log_dir>/tensorboard/events.out.tfevents.*`` where ``enabled``; else does nothing.

    ``purge_step``: the global step this process starts from: the checkpoint's on a resume, 0
    on a fresh run. Events already in the folder at that step or later (written by a run that
    crashed after its checkpoint; with 0, by an older run in the same folder, as the history
    file is rewritten too) are removed, and a restart marker hides them from a TensorBoard that
    loaded them already. None leaves the folder as it is.
    """

    def __init__(self, log_dir: Path, enabled: bool, purge_step: int | None = None):
        self.folder = Path(log_dir) / SUBDIR
        self._writer = None
        if enabled:
            # Imported here: ranks and runs without TensorBoard never pay for the import.
            from torch.utils.tensorboard import SummaryWriter

            self.folder.mkdir(parents=True, exist_ok=True)
            if purge_step is not None:
                dropped = truncate_event_files(self.folder, purge_step)
                if dropped:
                    log.info(
                        f"TensorBoard: removed {dropped} event(s) at step {purge_step} or "
                        f"later from {self.folder} (written after the point this run "
                        "starts from)"
                    )
            self._writer = SummaryWriter(
                str(self.folder), purge_step=purge_step, max_queue=MAX_QUEUE, flush_secs=FLUSH_SECS
            )

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    # -- writing ------------------------------------------------------------------------
    def add_step_metrics(self, global_step: int, metrics: Mapping[str, float]) -> None:
        """One point per metric at a logging step, as ``train/<name>`` (e.g. loss, lr,
        images_per_sec, data_wait_share)."""
        if self._writer is None:
            return
        self._add_scalars(
            {f"train/{name}": _number(name, value) for name, value in metrics.items()}, global_step
        )

    def add_epoch_record(self, global_step: int, record: Mapping[str, Any]) -> None:
        """Every numeric field of the epoch's history record, as ``epoch/<field>``, at the global
        step where the epoch ended; then flushes, so finished epochs are on disk."""
        if self._writer is None:
            return
        self._add_scalars(
            {
                f"epoch/{name}": float(value)
                for name, value in record.items()
                if isinstance(value, numbers.Real)
            },  # skips strings, None, lists
            global_step,
        )
        self._writer.flush()

    def add_run_end(
        self, global_step: int, hparams: Mapping[str, Any], final_metrics: Mapping[str, float]
    ) -> None:
        """The run's settings and final metrics, for TensorBoard's HPARAMS tab, in this run's
        own folder (see ``_write_hparams``); the metrics are also ``final/<name>`` scalars."""
        if self._writer is None:
            return
        metrics = {f"final/{name}": _number(name, value) for name, value in final_metrics.items()}
        self._write_hparams(global_step, hparams_for_tensorboard(hparams), list(metrics))
        self._add_scalars(metrics, global_step)
        self._writer.flush()

    def add_image_grid(
        self,
        images,
        tag: str = "train/augmented_images",
        global_step: int = 0,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        max_images: int = 16,
    ) -> None:
        """A grid of the first ``max_images`` of a batch [N, C, H, W]: uint8 (0-255), or float,
        normalised with ``mean``/``std`` if given, else in [0, 1]. It copies the images to the
        host (a GPU sync): call it once, outside the timed steps."""
        if self._writer is None:
            return
        grid = image_grid(images, mean, std, max_images)
        self._writer.add_image(tag, grid, global_step, dataformats="CHW")
        self._writer.flush()

    # -- lifetime ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Put everything queued on disk (cheap: a file flush; call it after a checkpoint, so
        the curves on disk reach at least as far as the checkpoint)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; later calls do nothing."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _add_scalars(self, values: dict[str, float], global_step: int) -> None:
        """All ``values`` as one event (``SummaryWriter.add_scalar`` makes one per value): each
        event costs a protocol buffer and a hand-over to the writer thread, about half the
        cost of a logging step with four values."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(
            value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()]
        )
        torch_compat.summary_file_writer(self._writer).add_summary(summary, global_step)

    def _write_hparams(
        self, global_step: int, hparams: dict[str, bool | float | str], metric_tags: list[str]
    ) -> None:
        """The hparams plugin's experiment and session summaries, in this writer's own file.

        torch's ``SummaryWriter.add_hparams`` writes them, with a copy of the metrics, into a new
        sub-folder named by the time (``tensorboard/1712345678.9/``): TensorBoard then lists a
        second run holding nothing but that table row, apart from the curves it describes. Here
        the session is this run itself: the HPARAMS row is the ``tensorboard`` run, its metric
        columns are its own ``final/*`` scalars, and a click on the row shows its curves.
        TensorBoard's own ``summary_v2`` builds the summaries (it keeps booleans as booleans,
        where torch's turns them into 0/1). They are written at ``global_step`` so that a
        restart marker hides them as it hides everything else.
        """
        from tensorboard.plugins.hparams import summary_v2

        experiment = summary_v2.hparams_config_pb(
            hparams=[summary_v2.HParam(name) for name in hparams],
            metrics=[summary_v2.Metric(tag) for tag in metric_tags],
        )
        session = summary_v2.hparams_pb(hparams)
        file_writer = torch_compat.summary_file_writer(self._writer)
        file_writer.add_summary(experiment, global_step)
        file_writer.add_summary(session, global_step)


def truncate_event_files(folder: Path, step: int) -> int:
    """Remove the events at ``step`` or later from the event files in ``folder``; returns how
    many. A file left with nothing (``step`` 0: a fresh run) is deleted; a rewritten file keeps
    its name, so the files still sort in the order they were written."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    dropped = 0
    for path in sorted(folder.glob("events.out.tfevents.*")):
        records = list(RawEventFileLoader(str(path)).Load())
        kept = [raw for raw in records if Event.FromString(raw).step < step]
        dropped += len(records) - len(kept)
        if not kept:
            path.unlink()
        elif len(kept) < len(records):
            # The temporary name lacks "tfevents": a TensorBoard watching the folder skips it.
            atomic_write(
                path,
                partial(_write_records, kept),
                partial(sum, map(len, kept)),
                tmp=folder / ".truncating.tmp",
            )
    return dropped


def _write_records(records: list[bytes], f) -> None:
    from tensorboard.summary.writer.record_writer import RecordWriter

    writer = RecordWriter(f)
    for raw in records:
        writer.write(raw)


def hparams_for_tensorboard(config: Mapping[str, Any]) -> dict[str, bool | float | str]:
    """The config as the hparams plugin accepts it: booleans, numbers and strings; anything
    else (None, lists, paths) as its text."""
    return {
        name: value if isinstance(value, (bool, int, float, str)) else str(value)
        for name, value in config.items()
    }


def image_grid(
    images,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    max_images: int = 16,
):
    """[3, H', W'] float grid in [0, 1] of up to ``max_images`` images (see ``add_image_grid``)."""
    import torch
    from torchvision.utils import make_grid

    if images.dim() != 4:
        raise ValueError(f"expected images [N, C, H, W], got shape {tuple(images.shape)}")
    batch = images[:max_images].detach().cpu()
    if batch.dtype == torch.uint8:
        batch = batch.float() / 255
    else:
        batch = batch.float()
        if mean is not None and std is not None:
            shape = (1, -1, 1, 1)
            batch = batch * torch.tensor(std).view(shape) + torch.tensor(mean).view(shape)
    return make_grid(batch.clamp(0, 1), nrow=min(8, len(batch)), padding=2)


def _number(name: str, value: Any) -> float:
    """A Python number as float. A tensor is refused: reading it here would wait for the GPU
    (the caller reads its values once, at the every-log_interval sync)."""
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"TensorBoard metric {name!r} must be a Python number, got "
            f"{type(value).__name__}; read tensors with .item() at the log sync"
        )
    return float(value)

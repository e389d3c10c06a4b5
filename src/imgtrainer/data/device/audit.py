"""The data audit: images the device made, checked against the CPU reference path as a run trains.

At the first batches of a run (and of each restart) and then every ``every``-th, one image of
the batch is made again on the CPU from its sample row (no new draws; on CUDA copied out without
waiting and remade in a thread of its own): decoded, cropped and resampled as the CPU path does.
The difference is measured in 0-255 levels; over the source's tolerance it is one warning, and
a high rate of mismatches among the recent audits asks for the CPU path (``switch_due``).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.host.sample_row import drawn_of, key_of, set_whole_crop
from imgtrainer.data.host.samples import Source, crop_pixels
from imgtrainer.events import event

log = logging.getLogger(__name__)

FIRST_BATCHES = 3  # the first batches of each start are all audited, then every ``every``-th
# A source gives way to the CPU path when SWITCH_AT of its last RECENT_AUDITS audits mismatched:
# a rate, so that a few odd images over a long run never switch it.
RECENT_AUDITS, SWITCH_AT = 20, 3
# Audits under way at most (the first batches' among them): a later one is skipped rather than
# queued behind a slow reference decode, each holding its image in pinned memory.
MAX_PENDING = FIRST_BATCHES
# The share of an image's values the audited difference leaves out: a uint8 policy op can turn
# a one-level rounding difference into a large one for a few pixels (a threshold, a histogram).
OUTLIER_SHARE = 0.001
# The largest difference (0-255 levels) a source may show against the CPU reference. On the
# CPU both halves run the same arithmetic: none. On CUDA: the banded resample (float32 or TF32
# in place of the gathered taps), bfloat16 or float16 batches (about half a level), and for
# nvJPEG its IDCT and chroma upsampling against libjpeg's (a few levels, more at sharp colour
# edges).
CPU_TOLERANCE = 0.5
CUDA_TOLERANCE = {Source.GPU: 3.0, Source.RAM: 3.0, Source.FILES: 3.0, Source.NVJPEG: 12.0}


def tolerance(source: Source, device: torch.device) -> float:
    """The largest audited difference (levels) a source shows on a healthy ``device``."""
    return CUDA_TOLERANCE[source] if device.type == "cuda" else CPU_TOLERANCE


@dataclass(frozen=True)
class Audited:
    """One audited image: its dataset index, and its difference from the reference (levels)."""

    index: int
    difference: float


class DataAudit:
    """Audits one image of the batches it is shown (``look``); ``reference`` is the dataset of
    the CPU path's images for the samples' indices (``TableImages`` or a cache's
    ``reference()``), ``augment`` the CPU ``BatchAugment`` with the run's settings; ``size`` the
    output size, ``source`` the training images' source, ``every`` the audit's period."""

    def __init__(
        self,
        reference: Dataset,
        augment: BatchAugment,
        source: Source,
        every: int,
        device: torch.device,
    ):
        self.reference, self.augment, self.source, self.every = reference, augment, source, every
        self.device = torch.device(device)
        self.tolerance = tolerance(source, self.device)
        self.seen = 0  # batches shown
        self.results: list[Audited] = []  # this epoch's, filled by the audit thread
        self.pending: list[Future] = []
        self.recent: collections.deque[bool] = collections.deque(maxlen=RECENT_AUDITS)
        self._lock = threading.Lock()
        # On CUDA the image is copied out without waiting and made again in a thread of its
        # own, on this device (not GPU 0's context). On the CPU it is on the host already and
        # is made at once in the training thread (a few ms every ``every`` batches): torch ops
        # in a second thread left every later step of a CPU run about 15% slower.
        self._thread = None
        if self.device.type == "cuda":
            self._thread = ThreadPoolExecutor(
                1,
                thread_name_prefix="data-audit",
                initializer=torch.cuda.set_device,
                initargs=(self.device,),
            )
        std = torch.tensor(augment.std, dtype=torch.float32).view(3, 1, 1)
        self._levels = std * 255  # a normalised difference in 0-255 levels, per channel

    def due(self) -> bool:
        """Whether the next batch is audited (counting it)."""
        self.seen += 1
        return self.seen <= FIRST_BATCHES or self.seen % self.every == 0

    def look(self, images: torch.Tensor, rows: torch.Tensor) -> None:
        """Audit one image of this augmented batch (``rows`` on the host) if it is due: its copy
        to the host is queued behind the batch's work, never waited for here."""
        if not self.due() or sum(not f.done() for f in self.pending) >= MAX_PENDING:
            return
        position = (self.seen - 1) % len(rows)
        image = images[position]
        if image.device.type == "cuda":
            host = torch.empty(image.shape, dtype=image.dtype, pin_memory=True)
            host.copy_(image, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(image.device))
        else:  # the loop may mix the batch in place next
            host, ready = image.clone(), None
        row = rows[position].clone()
        if self._thread is None:
            done: Future = Future()
            done.set_result(self._check(host, ready, row))
            self.pending.append(done)
        else:
            self.pending.append(self._thread.submit(self._check, host, ready, row))

    def _check(self, host: torch.Tensor, ready, row: torch.Tensor) -> None:
        """In the audit thread: the image made again, compared, recorded, warned about. An
        image the reference cannot make (a substitute for an unreadable file, gone since) is
        one warning, never a mismatch or the run's error."""
        if ready is not None:
            ready.synchronize()  # this thread waits, not the training one
        index, _ = key_of(row)
        try:
            expected = self.remake(row)
        except Exception as err:  # noqa: BLE001 - the audit must not end the run it checks
            log.warning(f"data audit: image {index} could not be made again on the CPU ({err})")
            return
        levels = (host.float() - expected).abs().mul_(self._levels).flatten()
        kept = max(1, int(round(len(levels) * (1 - OUTLIER_SHARE))))
        difference = float(levels.sort().values[kept - 1])
        with self._lock:
            self.results.append(Audited(index, difference))
            self.recent.append(difference > self.tolerance)
        if difference > self.tolerance:
            self.mismatched(index, difference)

    def remake(self, row: torch.Tensor) -> torch.Tensor:
        """The normalised image (3, size, size) float32 of a sample row on the CPU reference
        path: the reference image, the workers' crop of the box as drawn, the taps."""
        image, _ = self.reference[key_of(row)[0]]
        pixels = crop_pixels(image, drawn_of(row).tolist(), self.augment.size)
        row = row.clone()
        set_whole_crop(row, *pixels.shape[-2:])
        return self.augment(pixels[None], row[None])[0].float()

    def mismatched(self, index: int, difference: float) -> None:
        location = getattr(self.reference, "table", None)
        name = location.location(index) if location is not None else f"image {index}"
        log.warning(
            f"data audit: {name} made from {self.source} on {self.device} differs from the CPU "
            f"reference by {difference:.1f} levels (tolerance {self.tolerance:g})",
            extra=event("audit", image=str(name), difference=round(difference, 2)),
        )

    def switch_due(self) -> bool:
        """Whether SWITCH_AT of the last RECENT_AUDITS audits mismatched (then forgotten: the
        CPU path starts a new count)."""
        with self._lock:
            due = sum(self.recent) >= SWITCH_AT
            if due:
                self.recent.clear()
            return due

    def epoch_results(self) -> list[Audited]:
        """This epoch's audited images (waiting for the last ones), and a fresh list after."""
        for future in self.pending:
            future.result()  # a bug in the audit thread is raised here, in the loop's
        self.pending = []
        with self._lock:
            results, self.results = self.results, []
        return results

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)


def audit_summary(parts: Sequence[Sequence[Audited]]) -> dict[str, float]:
    """The epoch record's audit fields from every rank's audited images: how many, and the
    largest difference (0-255 levels; 0 when none was audited)."""
    every = [audited for part in parts for audited in part]
    largest = max((a.difference for a in every), default=0.0)
    return {"audit_images": len(every), "audit_max_diff": round(largest, 3)}

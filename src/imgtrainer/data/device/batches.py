"""Collated batches onto the training device, augmented there as a whole: the training loader
as the loop sees it. On CUDA the next batches' copies (a copy stream) and JPEG decoding (a thread
on a decoding stream) overlap the current step."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from imgtrainer.data.device.audit import DataAudit
from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.device.jpeg import JpegDecoder
from imgtrainer.data.host.collate import EncodedBatch, collate_samples
from imgtrainer.data.host.ragged import as_canvas
from imgtrainer.errors import UserError
from imgtrainer.events import event
from imgtrainer.torch_compat import none_if_out_of_memory, release_memory

log = logging.getLogger(__name__)

# Batches prepared ahead of the one being augmented: one copy ahead hides a copy; JPEG batches
# are decoded two ahead, so that a slow decode is caught up on by a faster one.
COPIES_AHEAD = 1
DECODES_AHEAD = 2


def ahead(batches: Iterable, start: Callable, finish: Callable, depth: int = 1) -> Iterator:
    """``finish(start(batch))`` for each batch, in order, with the next ``depth`` batches
    started before the current one is finished: their copy and decoding then overlap the
    current step."""
    started: collections.deque = collections.deque()
    for batch in batches:
        started.append(start(batch))
        if len(started) > depth:
            yield finish(started.popleft())
    while started:
        yield finish(started.popleft())


@dataclass(frozen=True)
class BatchPlan:
    """What a run decided about making its training batches, beyond the loader and the
    augmentation: images augmented at a time (``chunk``, the memory plan's; all when None),
    whether an out-of-memory error is retried in smaller pieces, the data audit, and the maker
    of the loader whose workers do the device's half on the CPU (``cpu_path``)."""

    chunk: int | None = None
    retry_on_oom: bool = False
    audit: DataAudit | None = None
    cpu_path: Callable[[], Iterable] | None = None


@dataclass
class Staged:
    """A collated batch on its way to the device: its tensors (or the decoding thread's future
    of them) and the event the compute stream waits on before it reads them; ``batch`` itself,
    made again here when its preparation ran out of memory (``started`` False)."""

    batch: tuple
    pixels: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    decoding: Future | None = None
    started: bool = True


class Streams(NamedTuple):
    """The copy and decoding streams, made once: new ones every epoch would come round the
    stream pool to the ones NCCL and nvjpeg draw from."""

    copies: torch.cuda.Stream
    decodes: torch.cuda.Stream


class DeviceBatches:
    """The training loader as the loop sees it: each loaded batch moved to ``device``
    (non-blocking from pinned memory) and augmented there as a whole; batches with JPEG
    bytes are first decoded there by ``jpegs`` (a ``JpegDecoder``). Anything else
    (``dataset``, ``num_workers``, ``sampler``) is the wrapped DataLoader's.

    On CUDA the next batches are prepared while the current one trains: their host-to-device
    copies on a copy stream of their own, their JPEG decoding in one background thread (on a
    decoding stream); the compute stream waits for their events, and the tensors are recorded
    on it so that the allocator does not hand their memory out early. Elsewhere each batch is
    made as it comes. The decoder then runs beside the main thread: it must be thread-safe, its
    CPU fallback included (which seeds the process's CPU generator). With ``retry_on_oom``, a
    batch whose preparation runs out of memory is made again here, in smaller pieces.

    ``plan.cpu_path()`` builds a loader whose workers do on the CPU what this source does on the
    device (the JPEG decoding; the device cache's crops). It takes over at the next epoch once
    the decoder has switched itself off, or once the data ``audit`` has found the device's
    images repeatedly unlike the CPU reference; without one, the augmentation takes its
    reference form (the gathered taps) instead."""

    def __init__(
        self,
        loader,
        augment: BatchAugment,
        device: torch.device,
        cache=None,
        jpegs: JpegDecoder | None = None,
        plan: BatchPlan | None = None,
    ):
        plan = plan or BatchPlan()
        self.loader, self.augment, self.device = loader, augment, torch.device(device)
        self.cache = cache  # the device cache's canvas when the batches are its indices
        self.jpegs, self.cpu_path = jpegs, plan.cpu_path
        self.chunk = plan.chunk  # halved on an out-of-memory error (``retry_on_oom``)
        self.retry_on_oom, self.audit = plan.retry_on_oom, plan.audit
        self.take_cpu_path = False  # from the next epoch on
        self._streams: Streams | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)

    @property
    def depth(self) -> int:
        """Batches prepared ahead of the one being augmented."""
        return DECODES_AHEAD if self.jpegs is not None else COPIES_AHEAD

    def streams(self) -> Streams:
        if self._streams is None:
            self._streams = Streams(torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def __iter__(self):
        jpegs_off = self.jpegs is not None and not self.jpegs.enabled
        if (jpegs_off or self.take_cpu_path) and self.cpu_path is not None:
            what = "every JPEG" if self.jpegs is not None else "every image, from its file"
            switch = event("data_path", switch="cpu_path", jpegs_only=self.jpegs is not None)
            self.loader, self.jpegs, self.cache = self.cpu_path(), None, None
            self.cpu_path = None
            log.info(f"The loader workers decode {what} from this epoch on", extra=switch)
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self.finish(self.stage(batch))
            return
        with ThreadPoolExecutor(1, thread_name_prefix="jpeg-decode") as thread:
            start = partial(self.stage, streams=self.streams(), thread=thread)
            yield from ahead(self.loader, start, self.finish, self.depth)

    def stage(
        self, batch: tuple, streams: Streams | None = None, thread: ThreadPoolExecutor | None = None
    ) -> Staged:
        """Start a collated batch on its way to the device: on CUDA its JPEG decoding in the
        decode ``thread``, or its copy on the copy stream; elsewhere made at once. Out of
        memory (with ``retry_on_oom``) it is left to ``finish``, which makes it again."""
        pixels, rows, labels = batch
        if thread is not None and isinstance(pixels, EncodedBatch):  # off the main thread
            future = thread.submit(self.decode_on, streams.decodes, pixels, rows, labels)
            return Staged(batch, rows=rows, decoding=future)
        staged = none_if_out_of_memory(
            partial(self.copy, batch, streams), self.retry_on_oom, self.device
        )
        return staged if staged is not None else Staged(batch, rows=rows, started=False)

    def copy(self, batch: tuple, streams: Streams | None) -> Staged:
        """The batch decoded (elsewhere than on CUDA), copied to the device and laid on its
        canvas, on the copy stream with the event of its end where there is one."""
        pixels, rows, labels = batch
        if isinstance(pixels, EncodedBatch):
            pixels, rows, labels = self.decode(pixels, rows, labels)
        if streams is None:
            return Staged(batch, *self.moved(pixels, rows, labels))
        with torch.cuda.stream(streams.copies):
            staged = Staged(batch, *self.moved(pixels, rows, labels), torch.cuda.Event())
            staged.ready.record(streams.copies)
        return staged

    def decode(
        self, batch: EncodedBatch, rows: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The one call of the JPEG decoder: (canvas on the device, sample rows, labels)."""
        return self.jpegs(batch, rows, labels)

    def decode_on(
        self, stream: torch.cuda.Stream, batch: EncodedBatch, rows, labels
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.Event]:
        """``decode`` on ``stream`` (in the decoding thread), with the event of its end."""
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            pixels, rows, labels = self.decode(batch, rows, labels)
            ready = torch.cuda.Event()
            ready.record(stream)
        return pixels, rows, labels, ready

    def moved(
        self, pixels: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pixels (or cache indices) and labels copied to the device (non-blocking: pinned by
        the loader); the sample rows stay on the host until used."""
        on_device = as_canvas(pixels.to(self.device, non_blocking=True))
        return on_device, rows, labels.to(self.device, non_blocking=True)

    def finish(self, staged: Staged) -> tuple[torch.Tensor, torch.Tensor]:
        """A staged batch, once its copy or decoding is done, augmented on the compute stream
        (and audited where due). A preparation that ran out of memory (with ``retry_on_oom``)
        is made again here, in smaller pieces: the same draws, the same images."""
        made = None
        if staged.started:
            attempt = partial(self.augmented_staged, staged)
            made = none_if_out_of_memory(attempt, self.retry_on_oom)
            if made is None:  # a failed decode's future holds its frames, and their memory
                staged.decoding = None
                release_memory(self.device)
        while made is None:
            self.smaller_pieces(len(staged.rows), "preparing a batch on the device")
            attempt = partial(self.apply, *staged.batch)
            made = none_if_out_of_memory(attempt, self.retry_on_oom, self.device)
        if self.audit is not None:
            self.audit.look(made[0], staged.rows)
        return made

    def augmented_staged(self, staged: Staged) -> tuple[torch.Tensor, torch.Tensor]:
        if staged.decoding is not None:
            pixels, rows, labels, ready = staged.decoding.result()
            labels = labels.to(self.device, non_blocking=True)
            staged = Staged(staged.batch, pixels, rows, labels, ready)
        if staged.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(staged.ready)
            for tensor in (staged.pixels, staged.labels):
                tensor.record_stream(compute)  # made on another stream, read (and freed) here
        return self.augmented(staged.pixels, staged.rows, staged.labels)

    def augmented(
        self, pixels: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels (or cache indices) and labels on the device -> (augmented images, labels),
        ``chunk`` images at a time (all when None); with ``retry_on_oom`` an out-of-memory
        error halves ``chunk`` and augments the batch again (its draws are on the host: the
        same images)."""
        attempt = partial(self.augmented_in_chunks, pixels, rows)  # each call reads the chunk
        while True:
            images = none_if_out_of_memory(attempt, self.retry_on_oom, self.device)
            if images is not None:
                return images, labels
            self.smaller_pieces(len(rows), "the augmentation")

    def augmented_in_chunks(self, pixels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        count = len(rows)
        step = min(count, self.chunk or count)
        parts = []
        for start in range(0, count, step):
            part = pixels[start : start + step]
            if self.cache is not None:  # indices of images already on the device
                part = self.cache.index_select(0, part)
            parts.append(self.augment(part, rows[start : start + step]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def smaller_pieces(self, count: int, where: str) -> None:
        """Half the images augmented at a time, and half the JPEGs decoded per call, from now
        on; an error once both are down to one."""
        current = min(count, self.chunk or count)
        decoding = self.jpegs is not None and self.jpegs.chunk > 1
        if current == 1 and not decoding:
            raise UserError(
                "out of memory augmenting a single image; use a smaller --image_size or "
                "--max_memory_gb, or free the device"
            )
        self.chunk = max(1, current // 2)
        if self.jpegs is not None:
            self.jpegs.chunk = max(1, self.jpegs.chunk // 2)
        log.warning(f"out of memory in {where}; {self.chunk} images at a time from now on")

    def apply(
        self, pixels: torch.Tensor | EncodedBatch, rows: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One collated batch -> (its augmented images, its labels) on the device, at once."""
        if isinstance(pixels, EncodedBatch):  # JPEG bytes: decoded on the device first
            pixels, rows, labels = self.decode(pixels, rows, labels)
        return self.augmented(*self.moved(pixels, rows, labels))

    def switch_to_reference(self) -> None:
        """At an epoch's end, once the data audit found this source's images unlike the CPU
        reference at a high rate on any rank (every rank switches, so none waits for another's
        slower path): its device half gives way to the loader workers' CPU path from the next
        epoch, or the augmentation takes its reference form. Never a decode in this process:
        it would hold every rank's step up."""
        if self.cpu_path is not None:
            self.take_cpu_path = True
            then = "the loader workers decode and crop every image from the next epoch on"
        else:
            self.augment.banded = False
            then = "the augmentation resamples with the gathered taps (the CPU's form) from now on"
        switch = event("data_path", switch="reference", cause="audit", cpu_path=self.take_cpu_path)
        log.warning(
            f"data audit: the device's images repeatedly differ from the CPU's; {then}",
            extra=switch,
        )

    def audit_results(self) -> tuple[list, bool]:
        """This epoch's audited images (``DataAudit.epoch_results``; none without an audit), and
        whether its recent mismatches ask for the CPU path (``DataAudit.switch_due``)."""
        if self.audit is None:
            return [], False
        return self.audit.epoch_results(), self.audit.switch_due()

    def preview(self, keys: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The augmented, normalised images of these (index, epoch) keys, as in training (read
        as a loader batch is: from an object store, at once)."""
        dataset = self.loader.dataset
        many = getattr(dataset, "__getitems__", None)
        batch = collate_samples(many(list(keys)) if many else [dataset[key] for key in keys])
        return self.apply(*batch)[0].float()  # float32 for image writers, whatever trains

"""Collated batches onto the training device, augmented there as a whole: the training loader
as the loop sees it. On CUDA the next batch's copy (a copy stream) and JPEG decoding (a thread on
a decoding stream) overlap the current step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.device.jpeg import JpegDecoder
from imgtrainer.data.host.collate import EncodedBatch, collate_samples
from imgtrainer.data.host.ragged import as_canvas
from imgtrainer.errors import UserError
from imgtrainer.torch_compat import none_if_out_of_memory

log = logging.getLogger(__name__)


def one_ahead(batches: Iterable, start: Callable, finish: Callable) -> Iterator:
    """``finish(start(batch))`` for each batch, in order, with the next batch started before
    the current one is finished: its copy and decoding then overlap the current step."""
    ahead = _NOTHING
    for batch in batches:
        started = start(batch)
        if ahead is not _NOTHING:
            yield finish(ahead)
        ahead = started
    if ahead is not _NOTHING:
        yield finish(ahead)


_NOTHING = object()


@dataclass
class Staged:
    """A batch on its way to the device: its tensors (or the decoding thread's future of
    them) and the event the compute stream waits on before it reads them."""

    pixels: torch.Tensor | None
    rows: torch.Tensor
    labels: torch.Tensor | None
    ready: torch.cuda.Event | None = None
    decoding: Future | None = None


class DeviceBatches:
    """The training loader as the loop sees it: each loaded batch moved to ``device``
    (non-blocking from pinned memory) and augmented there as a whole; batches with JPEG
    bytes are first decoded there by ``jpegs`` (a ``JpegDecoder``). Anything else
    (``dataset``, ``num_workers``, ``sampler``) is the wrapped DataLoader's.

    On CUDA the next batch is prepared while the current one trains: its host-to-device copy
    on a copy stream of its own, its JPEG decoding in one background thread (on a decoding
    stream); the compute stream waits for their events, and the tensors are recorded on it
    so that the allocator does not hand their memory out early. Elsewhere each batch is made
    as it comes: nothing to overlap. The decoder then runs beside the main thread: it must be
    thread-safe, its CPU fallback included (which seeds the process's CPU generator).

    Once the decoder has switched itself off (no JPEG decodes on the device), the next epoch
    takes its batches from ``without_jpegs()``: a loader whose workers decode every image."""

    def __init__(
        self,
        loader,
        augment: BatchAugment,
        device: torch.device,
        cache=None,
        jpegs: JpegDecoder | None = None,
        without_jpegs: Callable[[], Iterable] | None = None,
    ):
        self.loader, self.augment, self.device = loader, augment, torch.device(device)
        self.cache = cache  # the device cache's canvas when the batches are its indices
        self.jpegs, self.without_jpegs = jpegs, without_jpegs
        self.chunk: int | None = None  # images augmented at a time (the memory plan's)
        self.retry_on_oom = False

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)

    def __iter__(self):
        if self.jpegs is not None and not self.jpegs.enabled and self.without_jpegs is not None:
            self.loader, self.jpegs = self.without_jpegs(), None
            log.info("The loader workers decode every JPEG from this epoch on")
        if self.device.type != "cuda":
            for pixels, rows, labels in self.loader:
                yield self.apply(pixels, rows, labels)
            return
        copies, decodes = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        with ThreadPoolExecutor(1, thread_name_prefix="jpeg-decode") as thread:

            def start(batch) -> Staged:
                pixels, rows, labels = batch
                if isinstance(pixels, EncodedBatch):  # decoded off the main thread
                    future = thread.submit(self.decode_on, decodes, pixels, rows, labels)
                    return Staged(None, rows, None, decoding=future)
                with torch.cuda.stream(copies):
                    staged = Staged(*self.moved(pixels, rows, labels), torch.cuda.Event())
                    staged.ready.record(copies)
                return staged

            yield from one_ahead(self.loader, start, self.finish)

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
        the loader); the parameters stay on the host until used."""
        on_device = as_canvas(pixels.to(self.device, non_blocking=True))
        return on_device, rows, labels.to(self.device, non_blocking=True)

    def finish(self, staged: Staged) -> tuple[torch.Tensor, torch.Tensor]:
        """A staged batch, once its copy or decoding is done, augmented on the compute stream."""
        if staged.decoding is not None:
            pixels, rows, labels, ready = staged.decoding.result()
            staged = Staged(pixels, rows, labels.to(self.device, non_blocking=True), ready)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(staged.ready)
        for tensor in (staged.pixels, staged.labels):
            tensor.record_stream(compute)  # made on another stream, read (and freed) on this
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
            self.smaller_chunk(len(rows))

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

    def smaller_chunk(self, count: int) -> None:
        current = min(count, self.chunk or count)
        if current == 1:
            raise UserError(
                "out of memory augmenting a single image; use a smaller --image_size or "
                "--max_memory_gb, or free the device"
            )
        self.chunk = current // 2
        log.warning(f"out of memory in the augmentation; {self.chunk} images at a time from now on")

    def apply(
        self, pixels: torch.Tensor | EncodedBatch, rows: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One collated batch -> (its augmented images, its labels) on the device, at once."""
        if isinstance(pixels, EncodedBatch):  # JPEG bytes: decoded on the device first
            pixels, rows, labels = self.decode(pixels, rows, labels)
        return self.augmented(*self.moved(pixels, rows, labels))

    def preview(self, keys: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The augmented, normalised images of these (index, epoch) keys, as in training."""
        batch = collate_samples([self.loader.dataset[key] for key in keys])
        return self.apply(*batch)[0].float()  # float32 for image writers, whatever trains

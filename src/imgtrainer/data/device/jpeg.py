"""JPEG files decoded on the training device, with the CPU path where it fails.

Loader workers hand over a JPEG's raw bytes (``JpegBytes``) with the sample row drawn for its
header size; ``JpegDecoder`` decodes a batch's JPEGs in a few ``decode_jpeg`` calls (chunks),
crops each to its box (shrunk like the CPU path's PIL ``reduce``) and places them with the
batch's CPU-decoded samples on one canvas. What the device decoder fails on is decoded on the
CPU exactly as the CPU path does it, and a file it failed on is sent there from then on.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from imgtrainer import torch_compat
from imgtrainer.data.host.collate import EncodedBatch, JpegBytes
from imgtrainer.data.host.sample_row import crop_of, crop_size_of
from imgtrainer.data.host.samples import shrink_factor, shrunk_size
from imgtrainer.errors import first_line
from imgtrainer.events import event

log = logging.getLogger(__name__)


def device_decoder(device: torch.device) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """torchvision's batched JPEG decoding on ``device`` (nvjpeg on CUDA), to RGB. On CUDA its
    outputs are allocated on the calling thread's current stream (``JpegDecoder`` makes that
    its allocation stream) and are complete when it returns."""
    from torchvision.io import ImageReadMode, decode_jpeg

    # torchvision 0.29 warns at every call that its decoders move to torchcodec; once is plenty.
    # A filter, not catch_warnings: this runs in the decode thread beside the training thread.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision.io.image")

    def decode(data: list[torch.Tensor]) -> list[torch.Tensor]:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

    return decode


# A decoder call's outputs at most, in decoded bytes (a 12 MP photo decodes to 36 MB, a 24 MP one
# to 72 MB): a batch's JPEGs go in chunks of this many, each cropped and shrunk before the next
# is decoded; and JPEGs per call at most (halved after an out-of-memory error).
DECODE_BYTES = 256 << 20
DECODE_CHUNK = 64
# The float copy of a group of crops being shrunk at most (4 bytes a pixel): large crops are
# shrunk a few at a time, small ones many.
SHRINK_BYTES = 256 << 20
# The decoder's working memory at its peak, beside the canvas it fills: a chunk's outputs, then
# one shrink group's gathered crops (a packed copy and the padded canvas) and its float copy.
# One image larger than the bounds is still decoded, alone.
DECODER_PEAK_BYTES = DECODE_BYTES + SHRINK_BYTES * 3 // 2


def shrink(crop: torch.Tensor, factor: int) -> torch.Tensor:
    """PIL's ``reduce(factor)`` on the device: the mean of each factor x factor block (the last,
    partial blocks over the pixels they have), rounded to uint8."""
    if factor < 2:
        return crop
    mean = F.avg_pool2d(crop[None].float(), factor, ceil_mode=True)[0]
    return mean.round_().clamp_(0, 255).to(torch.uint8)


def upload(pixels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host pixels onto ``device``; to CUDA from pinned memory without blocking the host (the
    pinned block is kept until the copy is done by the caching host allocator)."""
    if device.type != "cuda":
        return pixels.to(device)
    return pixels.pin_memory().to(device, non_blocking=True)


@dataclass
class DecodeFailures:
    """What the device decoder failed on: the dataset indices of the files it failed on alone
    (decoded on the CPU from then on), and the error last seen."""

    bad: set[int] = field(default_factory=set)
    reported: int = 0  # len(bad) when last warned
    error: str = ""
    calls: int = 0  # decoder calls that failed
    alone: int = 0  # of them, calls with one file


class JpegDecoder:
    """(EncodedBatch, sample rows, labels) -> (uint8 canvas on ``device``, sample rows, labels),
    the rows' crop boxes then spanning each sample's pixels as on the CPU path.

    ``decode`` maps a list of JPEG byte tensors to RGB uint8 images on the device (default:
    ``decode_jpeg`` there), called with chunks of at most ``chunk`` JPEGs and DECODE_BYTES of
    outputs. A failing call is split in halves until the files it fails on alone are found;
    those are remembered (by dataset index) and made by ``fallback(key)`` -> (pixels, sample
    row, label), the CPU path with its handling of unreadable files, from then on without
    trying the device. ``size`` is the output size (large crops are shrunk by ``shrink_factor``
    first, as the loader workers do).

    On CUDA all of a call's device work runs on the decoder's own stream and only the canvas
    is handed to the consumer stream, so a call may run in a thread other than the one
    training (one call at a time per decoder): pass the training thread's stream as
    ``stream``; the default is the calling thread's current stream."""

    def __init__(
        self,
        device: torch.device,
        size: int,
        fallback: Callable[[tuple[int, int]], tuple[torch.Tensor, torch.Tensor, int]],
        decode: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
        chunk: int = DECODE_CHUNK,
    ):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # Fixed now: in a call from another thread, "cuda" would be that thread's device.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.size, self.fallback = device, size, fallback
        self.decode = decode or device_decoder(self.device)
        self.chunk = chunk
        self.failures = DecodeFailures()
        self.decoded = 0  # images the device decoder made
        self.enabled = True  # off once the device decoder fails on every image it is given
        cuda = self.device.type == "cuda"
        # The stream of the crops, shrinks and placing, and the stream nvjpeg's outputs are
        # allocated on, which runs no kernel (see __call__).
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.alloc_stream = torch.cuda.Stream(self.device) if cuda else None
        # One call at a time (the decode thread's, or a retry's in the training thread).
        self.calling = threading.Lock()

    def __call__(
        self,
        batch: EncodedBatch,
        rows: torch.Tensor,
        labels: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, labels = rows.clone(), labels.clone()
        if self.stream is None:  # not CUDA: no streams
            return self.assemble(batch, rows, labels), rows, labels
        consumer = stream or torch.cuda.current_stream(self.device)
        # Ordering of the nvjpeg decode (torchvision's decode_jpegs_cuda, read for 0.26-0.29):
        # - it allocates its outputs on the current stream, here self.alloc_stream, which runs
        #   no kernel, and decodes on a private stream that waits on no other: so it only ever
        #   writes blocks of self.alloc_stream's pool;
        # - every such block is an earlier output, recorded on self.stream (decode_all) where it
        #   was cropped: the caching allocator hands it out again only once that work is done;
        # - the outputs are complete when it returns (it synchronises its stream), and all
        #   cropping, shrinking and placing below runs on self.stream, after them;
        # - only the canvas leaves: the consumer waits for self.stream, and record_stream
        #   keeps its block from reuse until the consumer's queued work is done.
        # Nothing here waits on the consumer: no call waits for a training step. (Under the
        # cudaMallocAsync backend none of this holds: image_plan decodes on the CPU there.)
        with self.calling, torch.cuda.stream(self.stream):
            canvas = self.assemble(batch, rows, labels)
        consumer.wait_stream(self.stream)
        canvas.record_stream(consumer)
        return canvas, rows, labels

    def assemble(
        self, batch: EncodedBatch, rows: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The batch's canvas on the device (a sample the CPU path makes gets its row, label).
        Its work per image is the decoder's own and one view: crops, shrinks and placing run
        on whole chunks (``decode_chunk``)."""
        on_device = [
            (at, jpeg)
            for at, jpeg in zip(batch.jpeg_positions, batch.jpegs, strict=True)
            if self.enabled and jpeg.key[0] not in self.failures.bad
        ]
        sizes = {at: tuple(crop_size_of(rows[at]).tolist()) for at in batch.pixel_positions}
        boxes = crop_of(rows[[at for at, _ in on_device]]).tolist()
        for (at, _), (_, _, h, w) in zip(on_device, boxes, strict=True):
            sizes[at] = shrunk_size(h, w, self.size)
        canvas = torch.zeros(
            len(labels), 3, *canvas_size(sizes.values()), dtype=torch.uint8, device=self.device
        )
        if batch.pixels is not None:
            pixels = batch.pixels.to(self.device, non_blocking=True).canvas()
            put(canvas, batch.pixel_positions, pixels)
        made: set[int] = set()
        sizes_decoded = [jpeg.size for _, jpeg in on_device]
        for part in chunks(sizes_decoded, self.chunk, DECODE_BYTES):
            chunk = [on_device[n] for n in part]
            made |= self.decode_chunk(canvas, chunk, [boxes[n] for n in part], rows)
        self.report_failures()
        for jpeg, at in zip(batch.jpegs, batch.jpeg_positions, strict=True):
            if at not in made:  # the CPU path: its pixels, sample row and label
                pixels, rows[at], labels[at] = self.fallback(jpeg.key)
                sizes[at] = tuple(pixels.shape[-2:])
                canvas = grown(canvas, *sizes[at])
                canvas[at, :, : sizes[at][0], : sizes[at][1]] = upload(pixels, self.device)
        height, width = canvas_size(sizes.values())  # as large as the largest piece
        return canvas[:, :, :height, :width]

    def decode_chunk(
        self,
        canvas: torch.Tensor,
        chunk: list[tuple[int, JpegBytes]],
        boxes: list[list[int]],
        rows: torch.Tensor,
    ) -> set[int]:
        """Decode ``chunk``'s JPEGs, crop them to their ``boxes``, shrink and place them; the
        batch positions made. Crops are gathered and shrunk a group at a time: one shrink
        factor, and a float copy of at most SHRINK_BYTES (``shrink_groups``)."""
        indices = [jpeg.key[0] for _, jpeg in chunk]
        images = self.decode_all([jpeg.data for _, jpeg in chunk], indices)
        placed, kept, kept_boxes = [], [], []
        for (at, _), index, image, box in zip(chunk, indices, images, boxes, strict=True):
            top, left, h, w = box
            if image is not None and (image.shape[-2] < top + h or image.shape[-1] < left + w):
                # Smaller than its header said: not this file's device decoding again.
                self.failures.bad.add(index)
                self.failures.error = f"decoded {tuple(image.shape[-2:])}, box {box}"
            elif image is not None:
                placed.append(at)
                kept.append(image[:, top : top + h, left : left + w])  # a view: no copy yet
                kept_boxes.append(box)
        del images
        heights_widths = [box[2:] for box in kept_boxes]
        for group in shrink_groups(heights_widths, self.size, SHRINK_BYTES):
            factor = max(1, shrink_factor(*heights_widths[group[0]], self.size))
            sizes = torch.tensor([heights_widths[n] for n in group], dtype=torch.int64)
            crops = torch.zeros(
                len(group), 3, *sizes.amax(0).tolist(), dtype=torch.uint8, device=self.device
            )
            for piece, n in zip(crops, group, strict=True):  # a copy of the crop alone
                piece[:, : kept[n].shape[-2], : kept[n].shape[-1]] = kept[n]
            put(canvas, [placed[n] for n in group], shrink_group(crops, sizes, factor))
        made = [shrunk_size(h, w, self.size) for h, w in heights_widths]
        if placed:
            crop_of(rows)[placed] = torch.tensor([[0, 0, h, w] for h, w in made], dtype=rows.dtype)
        return set(placed)

    def decode_all(self, data: list[torch.Tensor], indices: list[int]) -> list[torch.Tensor | None]:
        """The images decoded on the device, None for those the CPU path must make."""
        if not self.enabled or not data:
            return [None] * len(data)
        failed, alone = self.failures.calls, self.failures.alone
        decoded = self.decode_split(data, indices)
        self.decoded += sum(image is not None for image in decoded)
        if self.failures.calls > failed and self.failures.alone == alone:
            self.smaller_chunks(len(data))  # no file's fault: the call's size (memory)
        if len(data) > 1 and not self.decoded:
            # Not one bad file: the device decoder does not work here (no nvjpeg).
            self.enabled = False
            self.failures.bad.difference_update(indices)
            log.warning(
                f"JPEG decoding on {self.device} failed for every image of a batch "
                f"({self.failures.error}); decoding every JPEG on the CPU from here on: in "
                "this process, one image at a time, until this epoch ends (expect it to be "
                "many times slower), then in the loader workers (--cache_images ram, or "
                "fixing nvjpeg, is faster)",
                extra=event("data_path", switch="nvjpeg_off", cause=str(self.failures.error)),
            )
        return decoded

    def decode_split(
        self, data: list[torch.Tensor], indices: list[int]
    ) -> list[torch.Tensor | None]:
        """``decode`` on ``data``; when it fails, on each half, down to single files, which
        are remembered as bad (at most 2 log2(n) calls more per bad file). A fault of the
        device itself (a CUDA error) ends the run: it is no file's."""
        try:
            return self.decode_on_device(data)
        except Exception as err:  # any decoder failure: split, then the CPU path decides
            if torch_compat.is_device_fault(err):
                raise
            self.failures.error = first_line(err)
            self.failures.calls += 1
            if len(data) == 1:
                self.failures.alone += 1
                self.failures.bad.add(indices[0])
                return [None]
        half = len(data) // 2
        return self.decode_split(data[:half], indices[:half]) + self.decode_split(
            data[half:], indices[half:]
        )

    def decode_on_device(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """One decoder call, its outputs allocated on the allocation stream and recorded on
        the decoder's stream, where they are read (see __call__)."""
        if self.alloc_stream is None:
            return list(self.decode(data))
        with torch.cuda.stream(self.alloc_stream):
            images = list(self.decode(data))
        for image in images:
            image.record_stream(self.stream)
        return images

    def smaller_chunks(self, failed: int) -> None:
        """Decode at most half of ``failed`` JPEGs per call from now on, and say so."""
        self.chunk = min(self.chunk, max(1, failed // 2))
        log.warning(
            f"the JPEG decoder on {self.device} failed on {failed} images at once "
            f"({self.failures.error}) but not on any alone; decoding {self.chunk} at a time "
            "from now on"
        )

    def report_failures(self) -> None:
        """One warning each time the count of files the device decoder failed on grows."""
        failures = self.failures
        if not self.enabled or len(failures.bad) == failures.reported:
            return
        log.warning(
            f"the JPEG decoder on {self.device} failed on {len(failures.bad) - failures.reported}"
            f" more file(s), {len(failures.bad)} so far (last: {failures.error}); they are "
            "decoded on the CPU, one at a time in the main process, from now on"
        )
        failures.reported = len(failures.bad)


def chunks(sizes: Sequence[tuple[int, int]], most: int, budget: int) -> list[list[int]]:
    """The positions of images of these (height, width)s in consecutive chunks of at most
    ``most`` images whose decoded bytes (3 per pixel) stay within ``budget``; an image over it
    alone is a chunk."""
    parts: list[list[int]] = []
    used = 0
    for n, (h, w) in enumerate(sizes):
        need = 3 * h * w
        if not parts or len(parts[-1]) >= most or used + need > budget:
            parts.append([])
            used = 0
        parts[-1].append(n)
        used += need
    return parts


def shrink_groups(crops: Sequence[tuple[int, int]], size: int, budget: int) -> list[list[int]]:
    """The positions of crops of these (height, width)s in groups that share a shrink factor
    and whose float canvas (4 bytes a pixel of n x 3 x the tallest x the widest) stays within
    ``budget``; a crop over it alone is a group."""
    by_factor: dict[int, list[int]] = {}
    for n, (h, w) in enumerate(crops):
        by_factor.setdefault(max(1, shrink_factor(h, w, size)), []).append(n)
    groups: list[list[int]] = []
    for members in by_factor.values():
        group: list[int] = []
        tallest = widest = 0
        for n in members:
            h, w = crops[n]
            if group and 12 * (len(group) + 1) * max(tallest, h) * max(widest, w) > budget:
                groups.append(group)
                group, tallest, widest = [], 0, 0
            group.append(n)
            tallest, widest = max(tallest, h), max(widest, w)
        groups.append(group)
    return groups


def shrink_group(crops: torch.Tensor, sizes: torch.Tensor, factor: int) -> torch.Tensor:
    """``shrink`` by ``factor`` of each crop on a canvas (N, 3, H, W) whose (height, width) are
    ``sizes`` (N, 2, on the host), as one pooling over the canvas: block sums divided by the
    count of each block's pixels inside its crop (the last, partial blocks as ``shrink``
    averages them; outside the crop: 0). Sums the same pixels in the same order as ``shrink``,
    so equal to it."""
    crops = crops[:, :, : int(sizes[:, 0].max()), : int(sizes[:, 1].max())]
    if factor < 2:
        return crops
    sums = F.avg_pool2d(crops.float(), factor, ceil_mode=True, divisor_override=1)
    device = crops.device
    heights, widths = (v[:, None, None, None] for v in sizes.to(device, non_blocking=True).T)
    rows = (heights - factor * torch.arange(sums.shape[-2], device=device)[:, None]).clamp(
        0, factor
    )
    cols = (widths - factor * torch.arange(sums.shape[-1], device=device)).clamp(0, factor)
    mean = sums.div_((rows * cols).clamp_(min=1))
    return mean.round_().clamp_(0, 255).to(torch.uint8)


def canvas_size(sizes) -> tuple[int, int]:
    """The (height, width) of a canvas that holds pieces of these (height, width)s."""
    heights, widths = zip(*sizes, strict=True) if sizes else ((1,), (1,))
    return max(heights), max(widths)


def grown(canvas: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``canvas``, or a larger copy of it when a piece of this size does not fit."""
    if height <= canvas.shape[-2] and width <= canvas.shape[-1]:
        return canvas
    larger = canvas.new_zeros(
        *canvas.shape[:2], max(height, canvas.shape[-2]), max(width, canvas.shape[-1])
    )
    larger[:, :, : canvas.shape[-2], : canvas.shape[-1]] = canvas
    return larger


def put(canvas: torch.Tensor, positions: list[int], pieces: torch.Tensor) -> None:
    """``pieces`` (len(positions), 3, h, w) at the top left of these images of ``canvas``, in
    one copy."""
    if not positions:
        return
    index = torch.tensor(positions).to(canvas.device, non_blocking=True)
    canvas[:, :, : pieces.shape[-2], : pieces.shape[-1]].index_copy_(0, index, pieces)

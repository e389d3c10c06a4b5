"""Training augmentation of whole batches on the training device.

The host draws each sample's parameters (``AugmentDraws``: crop box, flip, erasing rectangle,
the policy's ops) from the generator seeded by (seed, epoch, index); sources hand over uint8
pixels; ``BatchAugment`` then resamples every crop of the batch at once (a gather of a few taps
per output pixel and their weighted sum, columns then rows, with the weights of torch's
antialiased bilinear ``interpolate``; flips folded into them), applies the ``--auto_augment``
policy grouped by op (``data.batch_policy``), normalises and erases, on the batch's device.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from imgtrainer.config import TrainConfig
from imgtrainer.data.batch_policy import BatchPolicy, draw_policy
from imgtrainer.data.jpeg_device import EncodedBatch, JpegBytes, JpegDecoder, split_samples
from imgtrainer.data.params import (
    FLIP,
    HEIGHT,
    LEFT,
    NO_ERASE,
    NO_POLICY,
    TOP,
    WIDTH,
    erase_of,
    policy_of,
    row_of,
)
from imgtrainer.data.ragged import Ragged, as_canvas
from imgtrainer.data.resample import banded_resample, resample_taps, tap_count, weighted_taps
from imgtrainer.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from imgtrainer.errors import UserError
from imgtrainer.torch_compat import is_out_of_memory, release_memory

log = logging.getLogger(__name__)

CROP_TRIES = 10  # like torchvision's RandomResizedCrop, then a center crop
ERASE_TRIES = 10  # like torchvision's RandomErasing, then no erasing
ERASE_SCALE = (0.02, 0.33)  # torchvision's RandomErasing defaults
ERASE_RATIO = (0.3, 3.3)


def crop_box(
    height: int,
    width: int,
    u: Sequence[float],
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params as (top, left, h, w), fed with
    2 * CROP_TRIES + 2 uniforms in [0, 1)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for t in range(CROP_TRIES):
        target = area * (scale[0] + u[2 * t] * (scale[1] - scale[0]))
        aspect = math.exp(log_ratio[0] + u[2 * t + 1] * (log_ratio[1] - log_ratio[0]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return (
                int(u[2 * CROP_TRIES] * (height - h + 1)),
                int(u[2 * CROP_TRIES + 1] * (width - w + 1)),
                h,
                w,
            )
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def erase_box(size: int, u: Sequence[float], p: float) -> tuple[int, int, int, int]:
    """torchvision's RandomErasing.get_params on a size x size image as (top, left, h, w), fed
    with 1 + 2 * ERASE_TRIES + 2 uniforms; h = w = 0 when nothing is erased."""
    if u[0] >= p:
        return 0, 0, 0, 0
    log_ratio = (math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1]))
    for t in range(ERASE_TRIES):
        area = size * size * (ERASE_SCALE[0] + u[1 + 2 * t] * (ERASE_SCALE[1] - ERASE_SCALE[0]))
        aspect = math.exp(log_ratio[0] + u[2 + 2 * t] * (log_ratio[1] - log_ratio[0]))
        h = int(round(math.sqrt(area * aspect)))
        w = int(round(math.sqrt(area / aspect)))
        if 0 < h < size and 0 < w < size:
            top = int(u[-2] * (size - h + 1))
            left = int(u[-1] * (size - w + 1))
            return top, left, h, w
    return 0, 0, 0, 0


@dataclass(frozen=True)
class AugmentDraws:
    """The host half: one sample's parameters from torch's CPU generator (which the dataset
    seeds from (seed, epoch, index)), as its row (``data.params``). The crop uses the
    same uniforms, in the same order, as the per-image crop it replaces; then the ``policy``'s
    (``--auto_augment``) ops, with the calls of torchvision's policy."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    hflip: float = 0.5
    random_erasing: float = 0.0
    policy: str = "none"

    def __call__(self, height: int, width: int) -> torch.Tensor:
        u = torch.rand(2 * CROP_TRIES + 3).tolist()
        crop = crop_box(height, width, u[:-1], self.scale)
        policy = draw_policy(self.policy) if self.policy != "none" else NO_POLICY
        erase = NO_ERASE
        if self.random_erasing > 0:
            e = torch.rand(1 + 2 * ERASE_TRIES + 2).tolist()
            erase = erase_box(self.size, e, self.random_erasing)
        return row_of(crop, int(u[-1] < self.hflip), erase, policy)


class BatchAugment:
    """The device half: (uint8 pixels (N, 3, H, W), int64 parameters (N, PARAMS)) -> the
    normalised float32 batch (N, 3, size, size) (bfloat16 on CUDA where ``bfloat16``: the run
    trains under bfloat16 autocast), on the pixels' device, in the model's layout:
    channels_last in memory only where ``channels_last`` (--channels_last) and on CUDA, as the
    model is; contiguous NCHW otherwise.

    Each sample's crop box indexes its own image on the canvas (the padding is never read:
    its weights are zero). ``policy`` (TrivialAugment/RandAugment) applies the ops each sample
    drew to the resampled uint8 images, one op at a time for all the samples that drew it."""

    def __init__(
        self,
        size: int,
        policy: BatchPolicy | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        channels_last: bool = False,
        bfloat16: bool = False,
    ):
        self.size, self.policy = size, policy
        self.mean, self.std = tuple(mean), tuple(std)
        self.channels_last, self.bfloat16 = channels_last, bfloat16
        self.banded: bool | None = None  # the resample's form: None, by device (use_bmm)
        self._normalisers: dict = {}  # per device: (mean, std); per ("folded", device) too

    def normaliser(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and std as (1, 3, 1, 1) tensors on ``device``, copied there once."""
        if device not in self._normalisers:
            self._normalisers[device] = tuple(
                torch.tensor(v, device=device).view(1, 3, 1, 1) for v in (self.mean, self.std)
            )
        return self._normalisers[device]

    def folded_normaliser(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(x / 255 - mean) / std as x * scale + shift: (3,) float32 on ``device``, made once
        (from float64: within an ulp or two of the three float32 passes it replaces)."""
        key = ("folded", device)
        if key not in self._normalisers:
            mean = torch.tensor(self.mean, dtype=torch.float64)
            std = torch.tensor(self.std, dtype=torch.float64)
            self._normalisers[key] = ((1 / (255 * std)).float(), (-mean / std).float())
            self._normalisers[key] = tuple(v.to(device) for v in self._normalisers[key])
        return self._normalisers[key]

    def use_bmm(self, device: torch.device) -> bool:
        """The banded-matrix resample (``banded_resample``) on CUDA, unless ``banded`` says;
        the gathered taps elsewhere: the CPU's outputs, bit for bit the reference's."""
        return device.type == "cuda" if self.banded is None else self.banded

    def dtype(self, device: torch.device) -> torch.dtype:
        """The output's dtype on ``device``: bfloat16 on CUDA where the run trains under
        bfloat16 autocast (``bfloat16``), whose first layer would cast it so anyway: half the
        bytes written and read; float32 otherwise."""
        return torch.bfloat16 if self.bfloat16 and device.type == "cuda" else torch.float32

    def layout(self, device: torch.device) -> torch.memory_format:
        """The output's memory layout on ``device``: the one the model is in (``build``)."""
        if self.channels_last and device.type == "cuda":
            return torch.channels_last
        return torch.contiguous_format

    def resample(
        self, pixels: torch.Tensor, params: torch.Tensor, normalise: bool = False
    ) -> torch.Tensor:
        """Every crop resized to size x size and flipped where drawn: float, 0..255 (or
        normalised, where ``normalise`` and the banded form fold it into its weights). Each
        output pixel is a weighted sum of a few source pixels, columns then rows. ``params``
        on the host: the number of taps is read from it without a device sync."""
        size = self.size
        height_taps = tap_count(params[:, HEIGHT], size)
        width_taps = tap_count(params[:, WIDTH], size)
        params = params.to(pixels.device, non_blocking=True)
        if self.use_bmm(pixels.device):
            folded = self.folded_normaliser(pixels.device) if normalise else (None, None)
            images = banded_resample(pixels, params, size, (height_taps, width_taps), *folded)
            # Normalised: in the output's dtype and layout, one pass; 0..255 stays float32.
            dtype = self.dtype(pixels.device) if normalise else torch.float32
            return images.to(dtype, memory_format=self.layout(pixels.device))
        index, weights = resample_taps(params[:, LEFT], params[:, WIDTH], size, width_taps)
        flip = params[:, FLIP].bool()[:, None, None]
        index = torch.where(flip, index.flip(1), index)
        weights = torch.where(flip, weights.flip(1), weights)
        # Channels last, so that each gathered tap is a contiguous run of memory.
        across = pixels.permute(0, 3, 2, 1).contiguous()  # (N, W, H, 3)
        columns = weighted_taps(across, index, weights)  # (N, size, H, 3)
        index, weights = resample_taps(params[:, TOP], params[:, HEIGHT], size, height_taps)
        down = columns.transpose(1, 2).contiguous()  # (N, H, size, 3)
        rows = weighted_taps(down, index, weights)  # (N, size, size, 3)
        # (N, 3, size, size): channels_last in memory as computed, else one copy to NCHW.
        images = rows.permute(0, 3, 1, 2).contiguous(memory_format=self.layout(pixels.device))
        return self.normalise(images).to(self.dtype(pixels.device)) if normalise else images

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """0..255 floats to the normalised ones, in place, as torchvision's Normalize does."""
        mean, std = self.normaliser(images.device)
        return images.div_(255).sub_(mean).div_(std)

    def __call__(self, pixels: torch.Tensor | Ragged, params: torch.Tensor) -> torch.Tensor:
        """The batch's pixels on the training device, its parameters still on the host."""
        pixels = as_canvas(pixels)
        if self.policy is None:
            images = self.resample(pixels, params, normalise=True)
        else:  # its choices read on the host: no device sync
            images = self.resample(pixels, params).round_().clamp_(0, 255).to(torch.uint8)
            images = self.normalise(self.policy(images, policy_of(params)).float())
            images = images.to(self.dtype(pixels.device))
        return erase(images, params.to(pixels.device, non_blocking=True))


def erase(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Each sample's erasing rectangle set to 0 (the mean colour after normalisation, as in
    torchvision's recipe); samples with an empty rectangle are untouched."""
    size = images.shape[-1]
    at = torch.arange(size, device=images.device)
    top, left, height, width = erase_of(params)[:, :, None].unbind(1)
    rows = (at >= top) & (at < top + height)  # (N, size)
    cols = (at >= left) & (at < left + width)
    mask = rows[:, None, :, None] & cols[:, None, None, :]
    return images.masked_fill_(mask, 0.0)


def train_augmentation(
    cfg: TrainConfig, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> tuple[AugmentDraws, BatchAugment]:
    """The training augmentation of ``cfg``, the one place that reads the augmentation flags:
    RandomResizedCrop and the flip, then ``--auto_augment``'s policy, then random erasing, in
    the order of torchvision's reference recipe."""
    draws = AugmentDraws(
        cfg.image_size,
        scale=(cfg.crop_scale_min, 1.0),
        hflip=cfg.hflip,
        random_erasing=cfg.random_erasing,
        policy=cfg.auto_augment,
    )
    policy = BatchPolicy(cfg.auto_augment, cfg.image_size) if cfg.auto_augment != "none" else None
    # bfloat16 batches where CUDA trains under bfloat16 autocast (training.precision's rule there:
    # --use_amp with --amp_dtype bfloat16); BatchAugment applies it on CUDA only.
    bfloat16 = cfg.use_amp and cfg.amp_dtype == "bfloat16"
    augment = BatchAugment(cfg.image_size, policy, mean, std, cfg.channels_last, bfloat16=bfloat16)
    return draws, augment


def collate_samples(
    batch: list[tuple[torch.Tensor | int | JpegBytes, torch.Tensor, int]],
) -> tuple[torch.Tensor | EncodedBatch, torch.Tensor, torch.Tensor]:
    """Samples -> (pixels, params, labels): the samples' uint8 pixels packed as ``Ragged`` (only
    their bytes cross to the device, where ``as_canvas`` lays them on a canvas), or, for images
    cached on the device, their indices into the cache; a batch with JPEG bytes in it (decoded
    on the device) is an ``EncodedBatch`` holding its other samples packed and the bytes."""
    pixels, params, labels = zip(*batch, strict=True)
    labels_t = torch.tensor(labels, dtype=torch.int64)
    params_t = torch.stack(params)
    if isinstance(pixels[0], int):
        return torch.tensor(pixels, dtype=torch.int64), params_t, labels_t
    pixel_rows, jpeg_rows = split_samples(pixels)
    if jpeg_rows:
        packed = Ragged.of([pixels[n] for n in pixel_rows]) if pixel_rows else None
        jpegs = [pixels[n] for n in jpeg_rows]
        return EncodedBatch(packed, pixel_rows, jpegs, jpeg_rows), params_t, labels_t
    return Ragged.of(pixels), params_t, labels_t


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
    params: torch.Tensor
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
            for pixels, params, labels in self.loader:
                yield self.apply(pixels, params, labels)
            return
        copies, decodes = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        with ThreadPoolExecutor(1, thread_name_prefix="jpeg-decode") as thread:

            def start(batch) -> Staged:
                pixels, params, labels = batch
                if isinstance(pixels, EncodedBatch):  # decoded off the main thread
                    future = thread.submit(self.decode_on, decodes, pixels, params, labels)
                    return Staged(None, params, None, decoding=future)
                with torch.cuda.stream(copies):
                    staged = Staged(*self.moved(pixels, params, labels), torch.cuda.Event())
                    staged.ready.record(copies)
                return staged

            yield from one_ahead(self.loader, start, self.finish)

    def decode(
        self, batch: EncodedBatch, params: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The one call of the JPEG decoder: (canvas on the device, params, labels)."""
        return self.jpegs(batch, params, labels)

    def decode_on(
        self, stream: torch.cuda.Stream, batch: EncodedBatch, params, labels
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.Event]:
        """``decode`` on ``stream`` (in the decoding thread), with the event of its end."""
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            pixels, params, labels = self.decode(batch, params, labels)
            ready = torch.cuda.Event()
            ready.record(stream)
        return pixels, params, labels, ready

    def moved(
        self, pixels: torch.Tensor, params: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pixels (or cache indices) and labels copied to the device (non-blocking: pinned by
        the loader); the parameters stay on the host until used."""
        on_device = as_canvas(pixels.to(self.device, non_blocking=True))
        return on_device, params, labels.to(self.device, non_blocking=True)

    def finish(self, staged: Staged) -> tuple[torch.Tensor, torch.Tensor]:
        """A staged batch, once its copy or decoding is done, augmented on the compute stream."""
        if staged.decoding is not None:
            pixels, params, labels, ready = staged.decoding.result()
            staged = Staged(pixels, params, labels.to(self.device, non_blocking=True), ready)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(staged.ready)
        for tensor in (staged.pixels, staged.labels):
            tensor.record_stream(compute)  # made on another stream, read (and freed) on this
        return self.augmented(staged.pixels, staged.params, staged.labels)

    def augmented(
        self, pixels: torch.Tensor, params: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels (or cache indices) and labels on the device -> (augmented images, labels),
        ``chunk`` images at a time (all when None); with ``retry_on_oom`` an out-of-memory
        error halves ``chunk`` and augments the batch again (its draws are on the host: the
        same images)."""
        while True:
            try:
                return self.augmented_in_chunks(pixels, params), labels
            except Exception as err:  # only memory exhaustion is retried
                if not (self.retry_on_oom and is_out_of_memory(err)):
                    raise
            release_memory(self.device)  # outside the except block: the traceback is gone
            self.smaller_chunk(len(params))

    def augmented_in_chunks(self, pixels: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        count = len(params)
        step = min(count, self.chunk or count)
        parts = []
        for start in range(0, count, step):
            part = pixels[start : start + step]
            if self.cache is not None:  # indices of images already on the device
                part = self.cache.index_select(0, part)
            parts.append(self.augment(part, params[start : start + step]))
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
        self, pixels: torch.Tensor | EncodedBatch, params: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One collated batch -> (its augmented images, its labels) on the device, at once."""
        if isinstance(pixels, EncodedBatch):  # JPEG bytes: decoded on the device first
            pixels, params, labels = self.decode(pixels, params, labels)
        return self.augmented(*self.moved(pixels, params, labels))

    def preview(self, keys: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The augmented, normalised images of these (index, epoch) keys, as in training."""
        batch = collate_samples([self.loader.dataset[key] for key in keys])
        return self.apply(*batch)[0].float()  # float32 for image writers, whatever trains

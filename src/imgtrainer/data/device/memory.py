"""The augmentation's device memory, for the memory plan.

What it takes per image on top of its output, and the images augmented at a time that the
plan leaves room for. It runs on a whole loaded batch before the step's forward, while the
model, its gradients and the optimizer's state are in memory; the step's trials
(``training.memory_fit``) do not run it, so its transient tensors are counted here from their
shapes, and ``DeviceBatches`` augments ``chunk`` images at a time (halved on an out-of-memory
error, with ``--auto_micro_batch``).
"""

from __future__ import annotations

import math

from imgtrainer.data.device.batches import COPIES_AHEAD, DECODES_AHEAD
from imgtrainer.data.device.jpeg import DECODER_PEAK_BYTES
from imgtrainer.data.host.image_cache import CANVAS_ASPECT
from imgtrainer.data.host.samples import Source
from imgtrainer.data.host.transforms import EVAL_RESIZE_RATIO


def canvas_side_bound(size: int, source: Source) -> int:
    """The largest side of a batch canvas at output ``size``: the GPU cache keeps each image at
    most L x L (``stored_window``), L = 4/3 of its short side at the evaluation resize; other
    sources hand over crops whose short side ``shrink_factor`` keeps under 2 x ``size``, with
    the long side within 4:3 of it (RandomResizedCrop's aspect bounds)."""
    if source is Source.GPU:
        return math.ceil(CANVAS_ASPECT * math.ceil(size / EVAL_RESIZE_RATIO))
    return math.ceil(2 * CANVAS_ASPECT * size)


def staged_bytes(batch: int, size: int, source: Source) -> int:
    """Device bytes of the loaded batches beside the augmentation's own: the canvas being
    augmented and the batches prepared ahead of it (``DeviceBatches``). The GPU cache hands
    over indices: one canvas, gathered as it is augmented. Copied batches: one ahead, at its
    peak its packed copy beside its canvas. JPEG batches: decoded two ahead, and the decoder's
    working memory beside them (``DECODER_PEAK_BYTES``)."""
    canvas = batch * 3 * canvas_side_bound(size, source) ** 2
    if source is Source.GPU:
        return canvas
    if source is Source.NVJPEG:
        return canvas * (1 + DECODES_AHEAD) + DECODER_PEAK_BYTES
    return canvas * (1 + 2 * COPIES_AHEAD)


def augment_bytes_per_image(size: int, canvas_side: int, policy: bool) -> int:
    """Device bytes the augmentation of one image holds at its peak, beyond the canvas and the
    output it hands over, on a ``canvas_side`` square canvas (an upper bound: the tensors of
    CUDA's banded resample, ``resample.banded_chunk``): the float canvas, the columns,
    the rows' and the columns' weights; then the float output, its dtype and layout pass, and
    with a ``policy`` its uint8 image and float copies."""
    c, s = canvas_side, size
    resample = 4 * (3 * c * c + 3 * c * s + 3 * s * c + s * c)
    outputs = 4 * 3 * s * s * (3 if policy else 2)
    return resample + outputs


def augment_chunk(room_bytes: int, per_image: int, batch: int) -> int:
    """Images augmented at a time: as many of ``batch`` as ``room_bytes`` holds, at least 1."""
    return max(1, min(batch, room_bytes // per_image))

"""The augmentation's device memory is in the plan: it runs in chunks that fit beside the
model's state, the same images as in one go, and an out-of-memory error in it halves the chunk
and augments the batch again (with --auto_micro_batch), as the step's own retry does."""

from __future__ import annotations

import logging

import pytest
import torch

from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.device.batches import BatchPlan, DeviceBatches
from imgtrainer.data.device.memory import augment_bytes_per_image, augment_chunk, canvas_side_bound
from imgtrainer.data.device.policy import BatchPolicy
from imgtrainer.data.host.draws import AugmentDraws
from imgtrainer.data.host.ragged import Ragged
from imgtrainer.data.host.samples import Source
from imgtrainer.errors import UserError

HAS_CUDA = torch.cuda.is_available()
SIZE = 16


def batch(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    draws = AugmentDraws(SIZE, random_erasing=0.5, policy="trivialaugment")
    images, params = [], []
    for h, w in torch.randint(8, 40, (count, 2), generator=g).tolist():
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
        torch.manual_seed(h * 100 + w)
        params.append(draws(h, w))
    crops = []
    for image, row in zip(images, params, strict=True):
        top, left, h, w = row[:4].tolist()
        crops.append(image[:, top : top + h, left : left + w])
        row[:4] = torch.tensor([0, 0, h, w])
    return Ragged.of(crops).canvas(), torch.stack(params), torch.arange(count)


def device_batches(augment, chunk=None, retry_on_oom=False) -> DeviceBatches:
    return DeviceBatches([], augment, "cpu", plan=BatchPlan(chunk, retry_on_oom))


def test_chunks_make_the_images_of_one_go():
    pixels, params, labels = batch(10)
    augment = BatchAugment(SIZE, BatchPolicy("trivialaugment", SIZE))
    whole = device_batches(augment)
    chunked = device_batches(augment, chunk=3)  # 3, 3, 3, 1
    expected, _ = whole.augmented(pixels, params, labels)
    got, got_labels = chunked.augmented(pixels, params, labels)
    assert torch.equal(got, expected) and torch.equal(got_labels, labels)


class RunsOutAbove:
    """An augmentation that runs out of memory for more than ``limit`` images at once."""

    def __init__(self, limit: int, error: type[Exception] = torch.OutOfMemoryError):
        self.limit, self.error, self.sizes = limit, error, []
        self.real = BatchAugment(SIZE)

    def __call__(self, pixels, params):
        self.sizes.append(len(params))
        if len(params) > self.limit:
            raise self.error("CUDA out of memory. Tried to allocate 2 GiB")
        return self.real(pixels, params)


def test_out_of_memory_in_the_augmentation_halves_its_chunk_and_makes_the_same_images(caplog):
    pixels, params, labels = batch(8, seed=1)
    expected = BatchAugment(SIZE)(pixels, params)
    flaky = RunsOutAbove(3)
    batches = device_batches(flaky, retry_on_oom=True)
    with caplog.at_level(logging.WARNING):
        images, _ = batches.augmented(pixels, params, labels)
    assert torch.equal(images, expected)
    assert flaky.sizes == [8, 4, 2, 2, 2, 2] and batches.chunk == 2
    assert [r.message for r in caplog.records] == [
        "out of memory in the augmentation; 4 images at a time from now on",
        "out of memory in the augmentation; 2 images at a time from now on",
    ]
    images, _ = batches.augmented(pixels, params, labels)  # the next batch: chunks of 2 at once
    assert flaky.sizes[6:] == [2, 2, 2, 2]


def test_without_the_retry_or_at_one_image_the_error_stands():
    pixels, params, labels = batch(4, seed=2)
    batches = device_batches(RunsOutAbove(2))
    with pytest.raises(torch.OutOfMemoryError):
        batches.augmented(pixels, params, labels)
    batches = device_batches(RunsOutAbove(0), retry_on_oom=True)
    with pytest.raises(UserError, match="out of memory augmenting a single image"):
        batches.augmented(pixels, params, labels)
    batches = device_batches(RunsOutAbove(0, ValueError), retry_on_oom=True)
    with pytest.raises(ValueError):  # only memory errors are retried
        batches.augmented(pixels, params, labels)
    assert batches.augment.sizes == [4]


def test_the_plan_counts_the_augmentation_per_image_and_leaves_it_room():
    # 224 px: the GPU cache's canvas is at most 342 px a side (4/3 of 256), crops from files
    # at most 598 (under 2 x 224, within 4:3).
    assert canvas_side_bound(224, Source.GPU) == 342
    assert canvas_side_bound(224, Source.RAM) == canvas_side_bound(224, Source.FILES) == 598
    files = augment_bytes_per_image(224, 598, policy=False)
    assert 8e6 < files < 12e6  # about 2.5 GB for 256 images: the 0.7-3 GB seen by estimate
    assert augment_bytes_per_image(224, 342, policy=True) < files
    assert augment_chunk(10 * files, files, 256) == 10
    assert augment_chunk(10**15, files, 256) == 256
    assert augment_chunk(-5, files, 256) == 1  # no room at all: one at a time, then the retry


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_the_per_image_bound_holds_on_cuda():
    """The augmentation's peak above its canvas and output, on a canvas as large as the bound,
    stays under ``augment_bytes_per_image`` times the batch."""
    size, count = 224, 32
    side = canvas_side_bound(size, Source.FILES)
    pixels = torch.randint(0, 256, (count, 3, side, side), dtype=torch.uint8, device="cuda")
    draws = AugmentDraws(size, policy="trivialaugment")
    params = torch.stack([draws(side, side) for _ in range(count)])
    augment = BatchAugment(size, BatchPolicy("trivialaugment", size))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    images = augment(pixels, params)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - before - images.numel() * images.element_size()
    bound = count * augment_bytes_per_image(size, side, policy=True)
    print(f"transient {transient / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
    assert transient <= bound


def test_the_batches_prepared_ahead_are_reserved_beside_the_step_and_no_room_is_one_line():
    """The micro-batch trials' budget leaves room for the batches prepared ahead (alive through
    the step: 2 decoded nvJPEG canvases and the decoder's peak, about 1.2 GiB at 256 x 224 px);
    a budget with no room to augment one image is one error line, not one image at a time."""
    from imgtrainer.config import TrainConfig
    from imgtrainer.data.device.memory import DECODER_PEAK_BYTES
    from imgtrainer.training.memory_fit import (
        TrialInputs,
        TrialParts,
        plan_augmentation,
        prepared_ahead_bytes,
    )

    cfg = TrainConfig(batch_size=256, image_size=224)
    canvas = 256 * 3 * canvas_side_bound(224, Source.NVJPEG) ** 2
    ahead = prepared_ahead_bytes(cfg, Source.NVJPEG)
    assert ahead == 2 * canvas + DECODER_PEAK_BYTES and ahead > 1.1 * 2**30
    assert prepared_ahead_bytes(cfg, Source.GPU) == 0  # indices into the cache: nothing ahead
    model = torch.nn.Linear(4, 2)
    parts = TrialParts(model, torch.optim.SGD(model.parameters()), None, None, torch.device("cpu"))
    inputs = TrialInputs((3, 224, 224), 2)
    with pytest.raises(UserError, match="leaves no room to augment one image"):
        plan_augmentation(cfg, parts, inputs, budget=2**30, source=Source.NVJPEG)
    assert plan_augmentation(cfg, parts, inputs, 2**36, Source.NVJPEG) is None  # all at once


def test_a_decode_that_ran_out_of_memory_is_dropped_before_the_batch_is_made_again():
    """The decode thread's future keeps a failed attempt's frames (and their memory) alive:
    finish drops it before the batch is made again, smaller, in this thread."""
    from concurrent.futures import Future

    from imgtrainer.data.device.batches import Staged

    pixels, rows, labels = batch(4, seed=3)
    failed: Future = Future()
    failed.set_exception(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    staged = Staged((pixels, rows, labels), rows=rows, decoding=failed)
    batches = device_batches(BatchAugment(SIZE), retry_on_oom=True)
    images, _ = batches.finish(staged)
    assert staged.decoding is None and batches.chunk == 2
    expected, _ = device_batches(BatchAugment(SIZE)).augmented(pixels, rows, labels)
    assert torch.equal(images, expected)


def test_jpegs_are_decoded_by_the_workers_under_the_cudamallocasync_allocator(monkeypatch, caplog):
    """nvJPEG's private stream can write memory that queued work still reads under
    cudaMallocAsync (pytorch/vision#9606): the plan refuses the device decoder there, in one line."""
    from imgtrainer import torch_compat
    from imgtrainer.data.image_plan import safe_decoding

    monkeypatch.setattr(torch_compat, "cuda_allocator_backend", lambda: "native")
    assert safe_decoding(Source.NVJPEG) is Source.NVJPEG
    monkeypatch.setattr(torch_compat, "cuda_allocator_backend", lambda: "cudaMallocAsync")
    with caplog.at_level(logging.WARNING):
        assert safe_decoding(Source.NVJPEG) is Source.FILES
        assert safe_decoding(Source.RAM) is Source.RAM
    [line] = [r.getMessage() for r in caplog.records]
    assert "cudaMallocAsync" in line and "loader workers decode the JPEGs" in line

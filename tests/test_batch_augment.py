"""The batched augmentation (data.host.draws, data.device.augment): the host draws follow torchvision's
RandomResizedCrop, the batched resample is the per-image antialiased resize, flips are per
sample, padding on the canvas is never read, and the device path agrees with the CPU one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.device.batches import DeviceBatches, ahead
from imgtrainer.data.host import sample_row as layout
from imgtrainer.data.host.collate import collate_samples
from imgtrainer.data.host.draws import AugmentDraws, crop_box
from imgtrainer.data.host.sample_row import CROP, ERASE, FLIP, ROW_WIDTH, crop_of, crop_size_of
from imgtrainer.precision import Precision

HAS_CUDA = torch.cuda.is_available()


def smooth_image(height: int, width: int, seed: int = 0) -> torch.Tensor:
    """A natural-like uint8 picture: a few random sinusoids (gradients, edges of all sizes)."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.zeros(3, height, width)
    for _ in range(6):
        fy, fx, phase = (torch.rand(3, generator=g) * torch.tensor([0.3, 0.3, 6.3])).tolist()
        weight = torch.rand(3, 1, 1, generator=g)
        image += weight * torch.sin(fy * y + fx * x + phase)
    image = (image - image.min()) / (image.max() - image.min())
    return (image * 255).round().to(torch.uint8)


def box_params(boxes: list[tuple[int, int, int, int]], flips: list[int] | None = None):
    rows = torch.zeros(len(boxes), ROW_WIDTH, dtype=torch.int64)
    rows[:, CROP] = torch.tensor(boxes)
    if flips is not None:
        rows[:, FLIP] = torch.tensor(flips)
    return rows


def test_crop_boxes_follow_torchvisions_distribution_and_fallback():
    """Over 10,000 draws the histograms of area fraction and log aspect ratio match
    torchvision's RandomResizedCrop.get_params within sampling error (4 sigma per bin)."""
    height, width, n = 40, 60, 10_000
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    torch.manual_seed(0)
    ours = [crop_box(height, width, torch.rand(22).tolist(), scale, ratio) for _ in range(n)]
    reference = [
        v2.RandomResizedCrop.get_params(torch.empty(3, height, width), list(scale), list(ratio))
        for _ in range(n)
    ]  # torchvision 0.2x: v1's get_params, shared by v2

    def histograms(boxes):
        b = torch.tensor(boxes, dtype=torch.float64)
        area = b[:, 2] * b[:, 3] / (height * width)
        log_aspect = torch.log(b[:, 3] / b[:, 2])
        for top, left, h, w in boxes:
            assert 0 <= top and top + h <= height and 0 <= left and left + w <= width
        return (
            torch.histc(area, 10, 0, 1.0) / n,
            torch.histc(log_aspect, 10, -0.35, 0.35) / n,
            torch.histc(b[:, 0] / height, 5, 0, 1) / n,  # where the boxes sit
        )

    for a, b in zip(histograms(ours), histograms(reference), strict=True):
        sigma = torch.sqrt((a + b) / 2 * (1 - (a + b) / 2) * 2 / n)
        assert ((a - b).abs() <= 4 * sigma + 1e-3).all(), (a, b)
    # The fallback: no try fits (a strip far outside the ratio range, the area near 1):
    # torchvision's center crop at the nearest ratio.
    for shape in ((10, 200), (200, 10), (12, 100)):
        expected = v2.RandomResizedCrop.get_params(torch.empty(3, *shape), [0.9, 1.0], list(ratio))
        assert crop_box(*shape, torch.rand(22).tolist(), (0.9, 1.0), ratio) == tuple(expected)


def interpolated_crop(image: torch.Tensor, row: torch.Tensor, size: int) -> torch.Tensor:
    """The reference of one sample: its crop box (``row``) resized by torch's antialiased
    bilinear interpolate, unflipped, as float32 (3, size, size)."""
    top, left, h, w = crop_of(row).tolist()
    crop = image[None, :, top : top + h, left : left + w].float()
    return F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)[0]


def test_batched_resample_is_the_per_image_antialiased_resize():
    """Downscales and upscales of natural-like pictures of different sizes, on one padded
    canvas, against interpolate(crop, bilinear, antialias=True) of each crop alone: mean abs
    error below 1e-4 and max below 1e-3 (of 0..255): the same weights, float rounding apart."""
    torch.manual_seed(0)
    size = 24
    images = [
        smooth_image(h, w, seed) for seed, (h, w) in enumerate([(90, 70), (40, 64), (17, 30)])
    ]
    draws = AugmentDraws(size, hflip=0.0)
    errors = []
    for _ in range(10):
        samples = []
        for image in images:
            params = draws(*image.shape[-2:])
            samples.append((image, params, 0))
        pixels, params, _ = collate_samples(samples)
        pixels = pixels.canvas()  # packed as the loader sends it
        assert pixels.shape == (3, 3, 90, 70)  # the largest height and width
        batch = BatchAugment(size).resample(pixels, params)
        for n, image in enumerate(images):
            errors.append((batch[n] - interpolated_crop(image, params[n], size)).abs())
    errors = torch.stack(errors)
    print(f"mean abs error {errors.mean():.2e}, max {errors.max():.2e}")
    assert errors.mean() < 1e-4 and errors.max() < 1e-3, (errors.mean(), errors.max())


def test_the_banded_matrix_resample_is_the_gathered_one_within_float_rounding(monkeypatch):
    """The CUDA form (two bmm, normalisation folded into the weights) run on the CPU against
    the gathered taps, the CPU's reference: the same filter, flips and clamping, within
    float32 summation order; and against each crop's interpolate(antialias=True) within the
    reference's own tolerance (1e-3 of 0..255)."""
    torch.manual_seed(1)
    size = 24
    shapes = [(90, 70), (40, 64), (17, 30), (200, 31)]  # downscales, upscales, a tall strip
    images = [smooth_image(h, w, seed) for seed, (h, w) in enumerate(shapes)]
    draws = AugmentDraws(size, hflip=0.5)
    gathered, banded = BatchAugment(size), BatchAugment(size)
    banded.banded = True  # CUDA's form, here on the CPU
    for _ in range(5):
        pixels, params, _ = collate_samples([(im, draws(*im.shape[-2:]), 0) for im in images])
        pixels = pixels.canvas()  # packed as the loader sends it
        ours = banded.resample(pixels, params)
        assert ours.is_contiguous() and ours.dtype == torch.float32
        assert (ours - gathered.resample(pixels, params)).abs().max() < 1e-4
        assert (banded(pixels, params) - gathered(pixels, params)).abs().max() < 1e-5
        for n, image in enumerate(images):
            reference = interpolated_crop(image, params[n], size)
            if params[n, FLIP]:
                reference = reference.flip(-1)
            assert (ours[n] - reference).abs().max() < 1e-3
    # Large canvases go in groups of samples (here one at a time): the same images.
    from imgtrainer.data.device import resample

    monkeypatch.setattr(resample, "CHUNK_BYTES", 1)
    assert (banded.resample(pixels, params) - ours).abs().max() < 1e-5


def test_flips_are_per_sample_and_padding_is_never_read():
    image = smooth_image(30, 40)
    boxes = [(3, 5, 20, 30)] * 4
    pixels = image[None].repeat(4, 1, 1, 1)
    augment = BatchAugment(16)
    out = augment.resample(pixels, box_params(boxes, flips=[1, 0, 0, 1]))
    assert torch.allclose(out[0], out[1].flip(-1), atol=1e-4)
    assert torch.allclose(out[3], out[2].flip(-1), atol=1e-4)
    assert not torch.allclose(out[0], out[1], atol=1)
    # The model's layout (no copy in the step): contiguous NCHW on the CPU, where the model
    # ignores --channels_last, whatever the flag says.
    assert augment(pixels, box_params(boxes)).is_contiguous()
    flagged = BatchAugment(16, channels_last=True, precision=Precision(True, torch.bfloat16))
    assert flagged(pixels, box_params(boxes)).is_contiguous()
    assert torch.equal(flagged(pixels, box_params(boxes)), augment(pixels, box_params(boxes)))
    # On a larger canvas with garbage around the image: the same result.
    canvas = torch.full((4, 3, 50, 60), 255, dtype=torch.uint8)
    canvas[:, :, :30, :40] = pixels
    padded = augment.resample(canvas, box_params(boxes, flips=[1, 0, 0, 1]))
    assert torch.allclose(out, padded, atol=1e-4)
    # A box reaching the image's edge reads only the image: clamped as interpolate clamps.
    edge = augment.resample(canvas[:1], box_params([(10, 20, 20, 20)]))
    alone = F.interpolate(
        image[None, :, 10:30, 20:40].float(), (16, 16), mode="bilinear", antialias=True
    )
    assert (edge - alone).abs().max() < 1e-3


def test_the_config_chooses_the_batchs_layout_and_dtype():
    """--no_channels_last reaches the augmentation (defect 8); the batches in the dtype CUDA
    autocasts the first layer's input to (bfloat16 or float16), float32 without --use_amp
    and on the CPU."""
    from imgtrainer.config import TrainConfig
    from imgtrainer.data.loaders import train_augmentation

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # only compared, never used

    def augment(device: torch.device = cuda, **flags) -> BatchAugment:
        return train_augmentation(TrainConfig(image_size=16, **flags), device)[1]

    assert augment(channels_last=True).channels_last
    assert not augment(channels_last=False).channels_last
    assert augment(use_amp=True, amp_dtype="bfloat16").dtype(cuda) == torch.bfloat16
    assert augment(use_amp=True, amp_dtype="float16").dtype(cuda) == torch.float16
    assert augment(use_amp=False, amp_dtype="bfloat16").dtype(cuda) == torch.float32
    assert augment(cpu, use_amp=True, amp_dtype="bfloat16").dtype(cpu) == torch.float32
    assert augment(channels_last=False).layout(cuda) == torch.contiguous_format
    assert augment(channels_last=True).layout(cuda) == torch.channels_last
    assert augment(cpu, channels_last=True).layout(cpu) == torch.contiguous_format


def test_host_sources_hand_over_only_the_crop():
    """The sample's pixels are its crop box alone; the box then spans them."""
    from imgtrainer.data.host.samples import TrainingSamples

    image = smooth_image(40, 50)
    samples = TrainingSamples([(image, 1)], AugmentDraws(16, scale=(0.1, 0.3)), seed=5)
    pixels, params, label = samples[(0, 0)]
    assert label == 1 and crop_of(params)[:2].tolist() == [0, 0]
    assert tuple(pixels.shape[-2:]) == tuple(crop_size_of(params).tolist())
    assert pixels.shape[-2] * pixels.shape[-1] <= 0.35 * 40 * 50
    again, params_again, _ = samples[(0, 0)]
    assert torch.equal(again, pixels) and torch.equal(params_again, params)
    # From a large file, a crop twice the output size or more is shrunk by averaging blocks,
    # its short side to between the output size and twice it.
    from PIL import Image

    photo = Image.fromarray(smooth_image(400, 300).permute(1, 2, 0).numpy())
    big = TrainingSamples([(photo, 0)], AugmentDraws(16, scale=(0.5, 1.0)), seed=5)
    for epoch in range(5):
        pixels, params, _ = big[(0, epoch)]
        assert 16 <= min(pixels.shape[-2:]) < 32
        assert crop_size_of(params).tolist() == [*pixels.shape[-2:]]


def test_the_sample_row_is_one_int64_row_that_survives_the_collate():
    """A row is its crop, flip, erasing box and policy slots, in that order; the collate stacks
    the rows unchanged."""
    row = layout.row_of((1, 2, 3, 4), 1, (5, 6, 7, 8), tuple(range(10, 10 + layout.POLICY_WIDTH)))
    assert row.dtype == torch.int64 and len(row) == ROW_WIDTH
    assert crop_of(row).tolist() == [1, 2, 3, 4] and row[FLIP] == 1
    assert layout.erase_of(row).tolist() == [5, 6, 7, 8]
    assert layout.policy_of(row).tolist() == list(range(10, 10 + layout.POLICY_WIDTH))
    assert layout.slot_of(layout.policy_of(row), 1).tolist() == [13, 14, 15]
    layout.set_whole_crop(row, 30, 40)
    assert crop_of(row).tolist() == [0, 0, 30, 40]
    with pytest.raises(ValueError, match="columns"):
        layout.row_of((1, 2, 3, 4), 0, policy=(0,))
    rows = [layout.row_of((0, 0, 5, n), 0) for n in range(3)]
    _, stacked, _ = collate_samples([(torch.zeros(3, 5, 5, dtype=torch.uint8), r, 0) for r in rows])
    assert torch.equal(stacked, torch.stack(rows))


def test_erasing_draws_follow_torchvisions_rule():
    draws = AugmentDraws(32, hflip=0.0, random_erasing=1.0)
    torch.manual_seed(0)
    boxes = torch.stack([draws(40, 40) for _ in range(500)])[:, ERASE]
    top, left, h, w = boxes.T
    assert ((h > 0) & (h < 32) & (w > 0) & (w < 32)).float().mean() > 0.9
    erased = h > 0
    area = (h * w)[erased].double() / 32**2
    assert area.min() >= 0.015 and area.max() <= 0.36  # scale (0.02, 0.33), rounding
    assert (top + h <= 32).all() and (left + w <= 32).all()
    aspect = (h / w)[erased]
    assert 0.25 <= aspect.min() and aspect.max() <= 4  # ratio (0.3, 3.3), rounding
    assert math.isclose(float(area.mean()), (0.02 + 0.33) / 2, rel_tol=0.15)


def test_the_next_batch_is_started_before_the_current_one_is_finished():
    calls = []

    def start(batch):
        calls.append(("start", batch))
        return batch

    def finish(batch):
        calls.append(("finish", batch))
        return batch * 10

    assert list(ahead(range(3), start, finish)) == [0, 10, 20]
    assert calls == [
        *[("start", 0), ("start", 1), ("finish", 0)],
        *[("start", 2), ("finish", 1), ("finish", 2)],
    ]
    assert list(ahead([], start, finish)) == []
    calls.clear()  # two ahead: the decode-ahead depth of JPEG batches
    assert list(ahead(range(4), start, finish, depth=2)) == [0, 10, 20, 30]
    assert calls == [
        *[("start", 0), ("start", 1), ("start", 2), ("finish", 0)],
        *[("start", 3), ("finish", 1), ("finish", 2), ("finish", 3)],
    ]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_prefetched_batches_on_cuda_are_the_batches_made_one_at_a_time():
    """Copies on the copy stream and JPEG decoding in the background thread, one batch ahead:
    the same batches, in the same order, with the same values as made one by one."""
    import threading

    from torchvision.io import decode_jpeg, encode_jpeg

    from imgtrainer.data.device.jpeg import JpegDecoder
    from imgtrainer.data.host.collate import JpegBytes

    draws, cuda = AugmentDraws(16), torch.device("cuda")
    torch.manual_seed(0)
    images = [smooth_image(30 + 4 * n, 40 - 3 * n, n) for n in range(6)]
    samples = [(image, draws(*image.shape[-2:]), n) for n, image in enumerate(images)]
    jpegs = [
        (JpegBytes(encode_jpeg(image, quality=95), (n, 0), tuple(image.shape[-2:])), p, n)
        for image, p, n in samples
    ]
    threads = set()

    def decode(data):
        threads.add(threading.current_thread().name)
        return [decode_jpeg(d).to(cuda) for d in data]

    decoder = JpegDecoder(cuda, 16, lambda key: samples[key[0]], decode)
    for batch in (samples, jpegs):
        loader = torch.utils.data.DataLoader(
            batch, batch_size=2, collate_fn=collate_samples, pin_memory=True
        )
        batches = DeviceBatches(loader, BatchAugment(16), cuda, jpegs=decoder)
        one_by_one = [batches.apply(*b) for b in loader]
        prefetched = list(batches)
        assert len(prefetched) == len(one_by_one) == 3
        for (images_a, labels_a), (images_b, labels_b) in zip(prefetched, one_by_one, strict=True):
            assert torch.equal(images_a, images_b) and torch.equal(labels_a, labels_b)
    assert any(name.startswith("jpeg-decode") for name in threads)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_device_batches_on_cuda_agree_with_the_cpu_from_pinned_memory():
    images = [smooth_image(40, 30, 1), smooth_image(28, 50, 2)]
    draws = AugmentDraws(16)
    torch.manual_seed(0)
    batch = [(image, draws(*image.shape[-2:]), n) for n, image in enumerate(images)]
    loader = torch.utils.data.DataLoader(
        batch, batch_size=2, collate_fn=collate_samples, pin_memory=True
    )
    on_cuda = list(DeviceBatches(loader, BatchAugment(16), torch.device("cuda")))
    on_cpu = list(DeviceBatches(loader, BatchAugment(16), torch.device("cpu")))
    assert on_cuda[0][0].is_cuda and on_cuda[0][1].is_cuda
    # TF32 matmuls, where the trainer enables them, round to ~1e-3 relative.
    assert (on_cuda[0][0].cpu() - on_cpu[0][0]).abs().max() < 0.05
    assert torch.equal(on_cuda[0][1].cpu(), on_cpu[0][1])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_on_cuda_the_batch_comes_in_the_layout_the_flag_asks_for():
    """--channels_last: channels_last in memory, as the model is; --no_channels_last:
    contiguous NCHW, so that the model really trains NCHW; bfloat16 where training is.
    Values agree with the CPU."""
    image = smooth_image(30, 40).cuda()
    pixels = image[None].repeat(4, 1, 1, 1)
    params = box_params([(3, 5, 20, 30)] * 4, flips=[1, 0, 0, 1])
    on_cpu = BatchAugment(16)(pixels.cpu(), params)
    for flag, layout_ in ((True, torch.channels_last), (False, torch.contiguous_format)):
        out = BatchAugment(16, channels_last=flag)(pixels, params)
        assert out.is_contiguous(memory_format=layout_) and out.dtype == torch.float32
        assert (out.cpu() - on_cpu).abs().max() < 0.01  # TF32 bmm where enabled
        # Training under bfloat16 autocast: bfloat16 batches, in the same layout.
        bf16 = Precision(True, torch.bfloat16)
        half = BatchAugment(16, channels_last=flag, precision=bf16)(pixels, params)
        assert half.dtype == torch.bfloat16 and half.is_contiguous(memory_format=layout_)
        assert (half.float().cpu() - on_cpu).abs().max() < 0.02  # bfloat16: 8 bits


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cache_loader_gives_the_ram_cache_batches_on_the_device(tiny_dataset):
    """--cache_images gpu: the loader yields indices into one device canvas and the batch is
    made on the GPU; the same samples, draws and (up to float rounding) pixels as from RAM."""
    from dataclasses import replace

    from conftest import ONE_CPU_PROCESS, data_config
    from imgtrainer.data.host.samplers import EpochSampler
    from imgtrainer.data.loaders import LoaderSpec, build_datasets, make_loader, train_augmentation

    train, val = tiny_dataset
    batches = {}
    for cache, device in (("ram", "cpu"), ("gpu", "cuda")):
        cfg = data_config(train, val, image_size=16, seed=3, cache_images=cache)
        dist = replace(ONE_CPU_PROCESS, device=torch.device(device))
        train_set, *_ = build_datasets(cfg, dist)
        assert train_set.source == cache and (train_set.canvas is not None) == (cache == "gpu")
        sampler = EpochSampler(len(train_set), 0, 1, seed=3)
        loader = DeviceBatches(
            make_loader(train_set, sampler, LoaderSpec(8, train=True)),
            train_augmentation(cfg, torch.device(device))[1],
            torch.device(device),
            train_set.canvas,
        )
        batches[cache] = next(iter(loader))
    images, labels = batches["gpu"]
    assert images.is_cuda and torch.equal(labels.cpu(), batches["ram"][1])
    assert (images.cpu() - batches["ram"][0]).abs().max() < 0.01

"""The GPU cache's canvas on mixed-aspect photos, run on CPU tensors: each image cut to at most
ceil(4/3 S) per side before packing, the real size checked against the device budget before
anything is allocated (auto falls back to RAM, an explicit gpu is an error), and loader workers
that draw the same parameters as the main process without holding the canvas."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ONE_CPU_PROCESS, data_config, folder_images
from imgtrainer.data.host.draws import AugmentDraws
from imgtrainer.data.host.image_cache import DecodedImageCache, canvas_bytes, stored_window
from imgtrainer.data.host.samplers import EpochSampler
from imgtrainer.data.host.samples import CachedImageSizes, Source, TrainingSamples
from imgtrainer.data.host.transforms import eval_transforms
from imgtrainer.data.image_plan import Budgets, estimated_canvas_bytes, fit_device_cache
from imgtrainer.data.loaders import LoaderSpec, build_datasets, make_loader
from imgtrainer.errors import UserError


def padded_bytes(sizes) -> int:
    """A canvas of the whole images: num x 3 x the tallest x the widest."""
    return len(sizes) * 3 * max(h for h, _ in sizes) * max(w for _, w in sizes)


SIZE = 16  # the training cache's short side S = ceil(16 / 0.875) = 19, L = ceil(4/3 S) = 26
# (width, height): 16:9 in both orientations, 4:3, and (first class only) a 4:1 panorama
SHAPES = [(64, 36), (36, 64), (48, 36), (36, 48), (64, 36), (36, 64)]
PANORAMA = (128, 32)


def write_mixed(root: Path, seed: int = 0) -> Path:
    """Two classes of textured JPEGs of SHAPES, the first with one panorama."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(["a", "b"]):
        (root / name).mkdir(parents=True)
        for i, (w, h) in enumerate(SHAPES + ([PANORAMA] if c == 0 else [])):
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"img_{i}.jpg", quality=95)
    return root


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("mixed")
    return write_mixed(base / "train"), write_mixed(base / "val", seed=1)


def test_the_canvas_is_bounded_whatever_the_aspects(mixed):
    """Unbounded, the canvas is the tallest x the widest image (34 x 76 here: 3.8x the
    estimate); cut to the stored windows it is L x L, the estimate."""
    cache = DecodedImageCache(folder_images(mixed[0]).table, SIZE)
    whole = [image.clone() for image in cache.images]
    sizes = list(cache.sizes)
    assert cache.canvas is None and min(map(min, sizes)) == 19 and (19, 76) in sizes
    estimate = estimated_canvas_bytes(len(cache), SIZE)
    assert padded_bytes(sizes) == len(cache) * 3 * 34 * 76  # ~3.8x the estimate
    assert padded_bytes(sizes) / estimate > 3.8
    assert canvas_bytes(sizes, SIZE) == estimate == len(cache) * 3 * 26 * 26
    cache.pack("cpu")
    assert tuple(cache.canvas.shape) == (len(cache), 3, 26, 26)
    assert cache.nbytes == estimate
    for image, kept, (h, w), (top, left, kh, kw) in zip(
        whole, cache.images, sizes, [stored_window(h, w, SIZE) for h, w in sizes], strict=True
    ):
        assert tuple(kept.shape[-2:]) == (kh, kw) == (min(h, 26), min(w, 26))
        assert torch.equal(kept, image[:, top : top + kh, left : left + kw])
        if max(h, w) <= 26:  # 4:3 and squarer images are kept whole
            assert (top, left) == (0, 0) and torch.equal(kept, image)


def test_the_window_keeps_the_evaluation_centre_crop(mixed):
    """Validation images packed on the device evaluate exactly as they did unpacked."""
    transform = eval_transforms(SIZE, 0.8)
    cache = DecodedImageCache(folder_images(mixed[1]).table, SIZE, ratio=0.8)
    before = [transform(image) for image in cache.images]
    cache.pack("cpu")
    for expected, image in zip(before, cache.images, strict=True):
        assert torch.equal(transform(image), expected)
    for height in range(20, 80):  # every parity of the long side against the crop
        top, _, h, _ = stored_window(height, 19, SIZE)
        assert int(round((height - SIZE) / 2)) == top + int(round((h - SIZE) / 2))


def test_the_ram_cache_keeps_every_image_whole(mixed):
    """No window is cut for RAM: its crops are bit for bit the ones drawn before."""
    cache = DecodedImageCache(folder_images(mixed[0]).table, SIZE)
    assert cache.canvas is None and max(w for _, w in cache.sizes) == 76


def test_auto_falls_back_to_ram_when_the_real_canvas_is_over_the_budget(mixed, caplog):
    """The estimate fits the device budget but the decoded images do not (validation resized
    larger here): checked before packing, logged with the reason, nothing allocated there."""
    train, val = mixed
    cfg = data_config(train, val, image_size=SIZE, cache_images="auto", eval_resize_ratio=0.5)
    on_cuda = replace(ONE_CPU_PROCESS, device=torch.device("cuda"))  # never touched: no packing
    budget = estimated_canvas_bytes(len(SHAPES) * 4 + 2, SIZE)
    with caplog.at_level(logging.INFO, logger="imgtrainer"):
        train_set, *_ = build_datasets(cfg, on_cuda, budgets=Budgets(ram=2**30, device=budget))
    assert train_set.source is Source.RAM and train_set.images.canvas is None
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Image cache"))
    assert "Image cache: ram (auto: the GPU cache would take" in line
    assert "x the estimate), over" in line and line.endswith("; using ram)")


def test_an_explicit_gpu_cache_that_cannot_fit_is_one_error_before_packing(mixed):
    train, val = mixed
    cfg = data_config(train, val, image_size=SIZE, cache_images="gpu")
    on_cuda = replace(ONE_CPU_PROCESS, device=torch.device("cuda"))  # packing would fail here
    with pytest.raises(UserError, match=r"^--cache_images gpu: the decoded images need") as err:
        build_datasets(cfg, on_cuda, budgets=Budgets(device=10_000))
    assert "\n" not in str(err.value) and "use --cache_images ram" in str(err.value)


def test_the_device_cache_decision():
    assert fit_device_cache("auto", 10, 10, 0) == "gpu"  # no budget known: not checked
    assert fit_device_cache("gpu", 2**20, 2**20, 2**20) == "gpu"
    why = fit_device_cache("auto", 9 * 2**20, 2**20, 4 * 2**20)
    assert why == "auto: the GPU cache would take 9 MiB (9.0x the estimate), over 4 MiB; using ram"
    with pytest.raises(UserError):
        fit_device_cache("gpu", 9 * 2**20, 2**20, 4 * 2**20)


def test_loader_workers_draw_the_gpu_cache_parameters_of_the_main_process(mixed):
    """The loader's copy holds sizes and labels, not the canvas; 0 and 2 workers give the same
    batches (indices, every drawn parameter, labels) in the same order."""
    cache = DecodedImageCache(folder_images(mixed[0]).table, SIZE)
    cache.pack("cpu")
    draws = AugmentDraws(SIZE, random_erasing=0.5, policy="trivialaugment")
    samples = TrainingSamples(cache, draws, 7, Source.GPU)
    light = samples.for_loader()
    assert isinstance(light.images, CachedImageSizes) and light.canvas is None
    assert samples.canvas is cache.canvas
    batches = {}
    for workers in (0, 2):
        sampler = EpochSampler(len(samples), 0, 1, seed=7, global_batch=4)
        sampler.set_epoch(1)
        loader = make_loader(samples, sampler, LoaderSpec(4, True, num_workers=workers))
        assert loader.dataset.canvas is None
        batches[workers] = list(loader)
    assert len(batches[0]) == len(samples) // 4
    for zero, two in zip(batches[0], batches[2], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(zero, two, strict=True))
    keys = [(int(i), 1) for i in batches[0][0][0]]
    main = [samples[key] for key in keys]
    assert torch.equal(torch.stack([m[1] for m in main]), batches[0][0][1])


def test_the_bench_photos_are_mixed_aspect_jpegs_whose_gpu_cache_fits_the_estimate(tmp_path):
    """support/harness.py's photos (``write_split_folder(..., photos=True)``, its training
    split ``write_photo_folder``'s): JPEGs of at least 500 px, both orientations, 16:9 among
    them, one 4:1 panorama among the training images only, the same files for the same
    arguments; that panorama and the 9:16 portraits make the whole canvas ~4x the estimate,
    the stored windows 1x."""
    from support.harness import write_photo_folder, write_split_folder

    data = write_split_folder(tmp_path / "a", 2, 8, 1, 500, photos=True, threads=2)
    root = data / "train"
    again = write_photo_folder(tmp_path / "b", 2, 8, threads=2)
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 16
    assert all(
        f.read_bytes() == (again / f.relative_to(root)).read_bytes() for f in files
    )  # deterministic
    sizes = []
    for f in files:
        with Image.open(f) as image:
            assert image.format == "JPEG" and min(image.size) >= 500
            sizes.append(image.size)
    assert any(w > h for w, h in sizes) and any(h > w for w, h in sizes)
    assert any(abs(w / h - 16 / 9) < 0.01 for w, h in sizes)
    assert any(abs(h / w - 16 / 9) < 0.01 for w, h in sizes)
    assert sum(w == 4 * h for w, h in sizes) == 1
    validation = []
    for f in sorted((data / "val").rglob("*.jpg")):
        with Image.open(f) as image:
            validation.append(image.size)
    assert len(validation) == 2 and min(map(min, validation)) >= 500
    assert not any(w == 4 * h for w, h in validation)  # the panorama: training images only
    cache = DecodedImageCache(folder_images(root).table, 224, threads=2)
    estimate = estimated_canvas_bytes(len(cache), 224)
    assert padded_bytes(cache.sizes) > 3.9 * estimate  # 455 x 1024 against 342 x 342
    assert canvas_bytes(cache.sizes, 224) == estimate

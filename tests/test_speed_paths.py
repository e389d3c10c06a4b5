"""The decoded-image cache, --compile, and the throughput benchmark on tiny settings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import COLOURS, ROOT, SRC, TINY_FLAGS, run_cli
from data import (IMAGENET_MEAN, IMAGENET_STD, EpochSampler, ShardSampler, build_datasets,
                  make_loader)


def first_batches(train: Path, val: Path, cache: str):
    train_set, val_set, classes = build_datasets(train, val, 16, seed=0, crop_scale_min=0.5,
                                                 hflip=0.5, cache=cache)
    sampler = EpochSampler(len(train_set), rank=0, world_size=1, seed=0)
    train_loader = make_loader(train_set, sampler, 8, train=True, num_workers=0, pin_memory=False)
    val_loader = make_loader(val_set, ShardSampler(len(val_set), 0, 1), 8, train=False,
                             num_workers=0, pin_memory=False)
    return next(iter(train_loader)), next(iter(val_loader)), train_set, classes


def test_cached_batches_have_the_shape_dtype_range_and_labels_of_uncached(tiny_dataset):
    train, val = tiny_dataset
    (x_c, y_c), (vx_c, vy_c), cached_set, classes = first_batches(train, val, "ram")
    (x_u, y_u), (vx_u, vy_u), _, _ = first_batches(train, val, "none")
    images = cached_set.folder.images                              # kept compact in memory
    assert len(images) == 48 and all(i.dtype == torch.uint8 for i in images)
    assert {tuple(i.shape) for i in images} == {(3, 19, 19)}       # shorter side 16 / 0.875
    for cached, uncached in ((x_c, x_u), (vx_c, vx_u)):
        assert cached.shape == uncached.shape == (8, 3, 16, 16)
        assert cached.dtype == uncached.dtype == torch.float32
    lowest = min((0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    highest = max((1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    assert lowest - 1e-5 <= x_c.min() and x_c.max() <= highest + 1e-5
    assert torch.equal(y_c, y_u) and torch.equal(vy_c, vy_u)      # same order, same labels
    # The validation images are the same pictures: each class's colour survives the cache.
    assert (vx_c - vx_u).abs().mean() < 0.1
    # Each training image's mean colour matches the colour its label was generated with.
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    for image, label in zip(x_c, y_c):
        rgb = ((image * std + mean) * 255).mean(dim=(1, 2))
        assert torch.allclose(rgb, torch.tensor(COLOURS[label], dtype=torch.float32), atol=20)


def test_cached_and_uncached_training_reach_the_same_accuracy(tiny_dataset, tmp_path: Path):
    """Tolerance: both learn the colour-coded classes perfectly (val top-1 == 1.0)."""
    train, val = tiny_dataset
    accuracy = {}
    for cache in ("none", "ram"):
        workdir = tmp_path / cache
        workdir.mkdir()
        result = run_cli([SRC / "train_ddp.py", "--device", "cpu", "--train_dir", train,
                          "--val_dir", val, "--epochs", "4", "--cache_images", cache,
                          *TINY_FLAGS], cwd=workdir)
        assert result.returncode == 0, result.stderr
        history = json.loads((workdir / "logs" / "training_history.json").read_text())
        accuracy[cache] = history["epochs"][-1]["val_acc"]
    assert accuracy == {"none": 1.0, "ram": 1.0}


def test_compile_and_cache_through_the_launcher(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    result = run_cli([ROOT / "launch_ddp.py", "--device", "cpu", "--nproc", "2",
                      "--train_dir", train, "--val_dir", val, "--epochs", "1",
                      "--cache_images", "ram", "--compile", *TINY_FLAGS], cwd=tmp_path,
                     timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Cached 63 decoded images in ram" in result.stdout
    state = torch.load(tmp_path / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    assert not any("_orig_mod" in k or k.startswith("module.") for k in state["model_state_dict"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_gpu_cache_without_cuda_is_one_clear_error(tiny_dataset, tmp_path: Path):
    from conftest import assert_user_error

    train, val = tiny_dataset
    result = run_cli([SRC / "train_ddp.py", "--train_dir", train, "--val_dir", val,
                      "--cache_images", "gpu"], cwd=tmp_path)
    assert_user_error(result, "--cache_images gpu", "--cache_images ram")


def test_throughput_benchmark_runs_and_writes_its_json(tmp_path: Path):
    output = tmp_path / "throughput.json"
    result = run_cli([ROOT / "bench" / "throughput.py", "--image_size", "16", "--batch_size",
                      "4", "--warmup", "1", "--steps", "2", "--world_sizes", "1", "2",
                      "--startup_images", "0", "--output", output], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "efficiency" in result.stdout
    report = json.loads(output.read_text())
    assert [row["world_size"] for row in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["efficiency"] == pytest.approx(
            row["trainer"]["images_per_sec"] / row["ceiling"]["images_per_sec"])
        assert row["ceiling"]["images_per_sec"] > 0
        shares = row["trainer"]["step_shares"]
        assert {"data_wait", "forward_backward", "optimizer"} <= shares.keys()
        assert sum(shares.values()) == pytest.approx(1.0)
        assert row["trainer"]["seconds_to_first_step"] > 0
    assert report["results"][1]["trainer"]["allreduce_wait_share"] is not None


def test_fast_crop_matches_torchvision_resize_and_respects_its_bounds():
    from torchvision.transforms import v2

    from data import RandomResizedCropFlip

    torch.manual_seed(0)
    image = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
    whole = RandomResizedCropFlip(32, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.0)(image)
    reference = v2.functional.resize(image, [32, 32], antialias=True)
    assert whole.dtype == torch.uint8 and whole.shape == (3, 32, 32)
    assert (whole.int() - reference.int()).abs().max() <= 1          # same bilinear resize

    crop = RandomResizedCropFlip(16, scale=(0.2, 0.6))
    for _ in range(200):
        u = torch.rand(23).tolist()
        top, left, h, w = crop.crop_box(40, 60, u)
        assert 0 <= top and top + h <= 40 and 0 <= left and left + w <= 60
        assert 0.2 * 0.9 <= h * w / 2400 <= 0.6 * 1.1                 # scale bounds, rounding
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1                   # ratio bounds, rounding
    flips = [torch.equal(RandomResizedCropFlip(40, (1, 1), (1, 1), hflip=0.5)(image),
                         image.flip(-1)) for _ in range(200)]
    assert 60 < sum(flips) < 140


def test_auto_cache_uses_ram_only_when_it_fits():
    from data import choose_cache

    assert choose_cache("auto", 5400, 224, budget_bytes=2 * 2**30) == "ram"   # ~1.4 GB
    assert choose_cache("auto", 5400, 224, budget_bytes=2**30) == "none"
    assert choose_cache("none", 10, 32, budget_bytes=2**40) == "none"
    assert choose_cache("ram", 10**9, 224, budget_bytes=0) == "ram"          # explicit wins

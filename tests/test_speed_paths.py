"""The decoded-image cache and --compile on tiny settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (
    ONE_CPU_PROCESS,
    data_config,
    folder_images,
    launch_on_cpu,
    user_error_line,
)
from imgtrainer.config import parse_config
from imgtrainer.data.device.batches import DeviceBatches
from imgtrainer.data.host.image_cache import DecodedImageCache, SharedImageCache
from imgtrainer.data.host.samplers import EpochSampler, ShardSampler
from imgtrainer.data.host.transforms import eval_resize_side
from imgtrainer.data.loaders import (
    LoaderSpec,
    build_datasets,
    loader_workers,
    make_loader,
    train_augmentation,
)


def write_noise_images(root: Path, per_class: int, seed: int) -> Path:
    """Random pixels, so no class can be told by its colour, at the size the cache keeps for
    --image_size 16 (shorter side 19), in both orientations: the cache has nothing to resize,
    and must then hand out exactly the pixels of the uncached path."""
    side = eval_resize_side(16)
    rng = np.random.default_rng(seed)
    for c in ("a", "b", "c"):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            shape = (side, side + 5, 3) if i % 2 else (side + 3, side, 3)
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / c / f"{i}.png")
    return root


def two_epochs_of_batches(train: Path, val: Path, cache: str) -> tuple[list, object]:
    """Every training batch of epochs 1 and 2 (random crops and flips drawn), each followed by
    every val batch: with the RAM cache, epoch 1 fills it and epoch 2 reads it."""
    cfg = data_config(
        train, val, image_size=16, seed=0, crop_scale_min=0.3, hflip=0.5, cache_images=cache
    )
    train_set, val_set, *_ = build_datasets(cfg, ONE_CPU_PROCESS)
    sampler = EpochSampler(len(train_set), rank=0, world_size=1, seed=0)
    train_loader = DeviceBatches(
        make_loader(train_set, sampler, LoaderSpec(4, train=True)),
        train_augmentation(cfg, torch.device("cpu"))[1],
        torch.device("cpu"),
    )
    val_loader = make_loader(val_set, ShardSampler(len(val_set), 0, 1), LoaderSpec(4, train=False))
    batches = []
    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        batches += [*train_loader, *val_loader]
    return batches, train_set.images


def test_cached_batches_are_the_uncached_ones_bitwise(tmp_path: Path):
    train = write_noise_images(tmp_path / "train", 6, seed=1)
    val = write_noise_images(tmp_path / "val", 3, seed=2)
    cached, cache = two_epochs_of_batches(train, val, "ram")
    uncached, folder = two_epochs_of_batches(train, val, "none")
    assert isinstance(cache, SharedImageCache) and not isinstance(folder, SharedImageCache)
    assert cache.filled == len(cache) == 18  # epoch 1 filled it; epoch 2 read it
    assert cache.pixels.dtype == torch.uint8  # kept compact
    assert len(cached) == len(uncached) == 2 * (4 + 3)  # 18 train, 9 val
    for (x_c, y_c), (x_u, y_u) in zip(cached, uncached, strict=True):
        assert x_c.dtype == x_u.dtype == torch.float32 and x_c.shape[1:] == (3, 16, 16)
        assert torch.equal(y_c, y_u) and torch.equal(x_c, x_u)


def test_cache_keeps_the_evaluation_resize_of_larger_images(tmp_path: Path):
    """Larger pictures are stored with their shorter side at 19 px (16 / 0.875), aspect kept."""
    for name, size in (("wide", (40, 30)), ("tall", (20, 60)), ("small", (8, 8))):
        (tmp_path / "a").mkdir(exist_ok=True)
        Image.new("RGB", size, (90, 20, 200)).save(tmp_path / "a" / f"{name}.png")
    cache = DecodedImageCache(folder_images(tmp_path).table, image_size=16)
    shapes = {
        Path(cache.table.location(i)).stem: tuple(image.shape)
        for i, image in enumerate(cache.images)
    }
    assert shapes == {"wide": (3, 19, 25), "tall": (3, 57, 19), "small": (3, 19, 19)}
    assert all(
        torch.equal(image[:, 0, 0], torch.tensor([90, 20, 200], dtype=torch.uint8))
        for image in cache.images
    )  # solid colours stay


def test_compile_wraps_the_model_and_unwraps_for_checkpoints():
    """What --compile builds; that it compiles for real is the slow launcher test's job."""
    from torch._dynamo.eval_frame import OptimizedModule

    from imgtrainer.distributed.setup import DistInfo
    from imgtrainer.models import unwrap_model
    from imgtrainer.training.build import wrap_model

    one_cpu_process = DistInfo(0, 0, 1, 1, torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    compiled = wrap_model(model, parse_config(["--compile"]), one_cpu_process)
    assert isinstance(compiled, OptimizedModule) and compiled._orig_mod is model
    assert unwrap_model(compiled) is model
    assert wrap_model(model, parse_config([]), one_cpu_process) is model


@pytest.mark.slow
def test_compile_and_cache_through_the_launcher(tiny_dataset, tmp_path: Path):
    train, val = tiny_dataset
    # TORCH_LOGS=dynamo: torch.compile says when it traced a frame and compiled its graph (with
    # DDP, through DDP's graph-splitting wrapper around inductor, so no backend name is checked).
    result = launch_on_cpu(
        train,
        val,
        # timm's small ResNet: fewer layers for inductor to compile than resnet18's.
        *("--epochs", "1", "--cache_images", "ram", "--compile", "--model", "test_resnet"),
        cwd=tmp_path,
        timeout=600,
        env={"TORCH_LOGS": "dynamo"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Image cache: ram (--cache_images ram; filled as the images are first read" in (
        result.stdout
    )
    output = result.stdout + result.stderr
    assert "torchdynamo done tracing forward" in output
    assert "done compiler function" in output
    state = torch.load(tmp_path / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    assert not any("_orig_mod" in k or k.startswith("module.") for k in state["model_state_dict"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_gpu_cache_without_cuda_is_one_clear_error(tiny_dataset, tmp_path: Path, capsys):
    import imgtrainer.run.train as train_ddp

    train, val = tiny_dataset
    line = user_error_line(
        train_ddp.main,
        ["--train_dir", train, "--val_dir", val, "--cache_images", "gpu"],
        capsys,
        cwd=tmp_path,
    )
    assert "--cache_images gpu" in line and "--cache_images ram" in line


def test_auto_cache_picks_the_device_then_ram_then_files():
    from imgtrainer.data.image_plan import Budgets, choose_cache

    assert choose_cache("auto", 5400, 224, Budgets(ram=2 * 2**30))[0] == "ram"  # ~1.4 GB
    assert choose_cache("auto", 5400, 224, Budgets(ram=2**30))[0] == "none"
    # The device canvas (a square of the longer side, ~1.8 GB) when it fits the device budget.
    choice, why = choose_cache("auto", 5400, 224, Budgets(2 * 2**30, device=2 * 2**30))
    assert choice == "gpu" and "MiB fit in 25% of the free device memory" in why
    choice, why = choose_cache("auto", 5400, 224, Budgets(2 * 2**30, device=2**30))
    assert choice == "ram" and "too large for the device" in why
    assert choose_cache("none", 10, 32, Budgets(ram=2**40))[0] == "none"
    assert choose_cache("ram", 10**9, 224) == ("ram", "--cache_images ram")


def test_loader_workers_rule():
    """--num_workers wins; else sized to the cores per process and to the source: with a GPU,
    one core drives it and the others decode files (half of them for images in RAM, half and
    at most 4 to draw the GPU cache's parameters); on the CPU the model takes the cores."""
    assert loader_workers(3, 16, "cpu", "ram") == 3
    assert loader_workers(3, 16, "cuda", "gpu") == 3
    assert loader_workers(None, 16, "cuda", "gpu") == 4
    assert loader_workers(None, 6, "cuda", "gpu") == 2
    assert loader_workers(None, 2, "cuda", "gpu") == 1  # the draws still overlap the step
    assert loader_workers(None, 16, "cuda", "files") == 15
    assert loader_workers(None, 16, "cuda", "nvjpeg") == 15  # files too, JPEGs as bytes
    assert loader_workers(None, 16, "cuda", "ram") == 7
    assert loader_workers(None, 64, "cuda", "files") == 16  # each worker holds its batches
    # 8 GPUs on 16 cores: 2 cores per process, one worker whatever the source.
    assert loader_workers(None, 2, "cuda", "files") == loader_workers(None, 2, "cuda", "ram") == 1
    assert loader_workers(None, 1, "cuda", "files") == 1  # the data still overlaps the step
    assert loader_workers(None, 0, "cuda", "files") == 0
    assert loader_workers(None, 2, "cpu", "files") == 2
    assert loader_workers(None, 16, "cpu", "files") == 4
    assert loader_workers(None, 16, "cpu", "ram") == 0


def test_the_loader_workers_follow_the_cores_and_the_source(tmp_path, monkeypatch, caplog):
    """The loaders (``open_data``) read the cores this process may use, shares them with the node's other
    processes, and logs its choice."""
    import logging

    from imgtrainer.data import loaders
    from imgtrainer.distributed.setup import DistInfo

    write_noise_images(tmp_path / "train", 4, seed=1)
    write_noise_images(tmp_path / "val", 1, seed=2)
    monkeypatch.setattr(loaders, "cpu_cores_available", lambda: 16)
    two_on_node = DistInfo(0, 0, 1, 2, torch.device("cpu"))
    flags = ["--train_dir", str(tmp_path / "train"), "--val_dir", str(tmp_path / "val")]
    flags += ["--image_size", "16", "--batch_size", "4", "--log_dir", str(tmp_path / "logs")]
    with caplog.at_level(logging.INFO, logger="imgtrainer"):
        train, *_ = loaders.open_data(
            parse_config([*flags, "--cache_images", "none"]), two_on_node
        ).loaders()
        cached, *_ = loaders.open_data(
            parse_config([*flags, "--cache_images", "ram"]), two_on_node
        ).loaders()
    assert (train.num_workers, cached.num_workers) == (4, 0)
    assert "Loader: 4 worker(s) per process, images from files (8 CPU core(s)" in caplog.text
    assert "Loader: 0 worker(s) per process, images from ram" in caplog.text

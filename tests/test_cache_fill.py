"""The RAM cache fills while the first epoch runs: the first step waits for no decoding of the
whole folder, what loader workers decode lands in memory the training process reads, and
every image is the same from the cache, from its file, or past the cache's capacity."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import torch

from conftest import CLASSES, ONE_CPU_PROCESS, data_config, folder_images, write_image_folder
from imgtrainer.data.device.batches import DeviceBatches
from imgtrainer.data.host.image_cache import SharedImageCache, decode_resized
from imgtrainer.data.host.samplers import EpochSampler
from imgtrainer.data.host.transforms import eval_resize_side
from imgtrainer.data.layouts.table import READABLE
from imgtrainer.data.loaders import LoaderSpec, build_datasets, make_loader, train_augmentation
from imgtrainer.process import process_map

SIZE = 16


def folders(tmp_path: Path, per_class: int = 8) -> tuple[Path, Path]:
    return (
        write_image_folder(tmp_path / "train", CLASSES, per_class, seed=1),
        write_image_folder(tmp_path / "val", CLASSES, 2, seed=2),
    )


def assert_holds_the_files_decode(cache: SharedImageCache) -> None:
    side = eval_resize_side(SIZE)
    for index in range(len(cache)):
        kept = cache.cached(index)
        expected = decode_resized(cache.table, index, side)
        assert kept is not None and torch.equal(kept, expected), cache.table.location(index)


def test_the_first_step_waits_for_no_cache_and_epoch_one_fills_it(tmp_path: Path):
    train, val = folders(tmp_path)
    cfg = data_config(train, val, image_size=SIZE, seed=0, cache_images="ram")
    train_set, val_set, *_ = build_datasets(cfg, ONE_CPU_PROCESS)
    cache = train_set.images
    assert isinstance(cache, SharedImageCache) and cache.filled == 0 == cache.nbytes
    sampler = EpochSampler(len(train_set), 0, 1, seed=0)
    sampler.set_epoch(1)
    batches = iter(
        DeviceBatches(
            make_loader(train_set, sampler, LoaderSpec(4, train=True)),
            train_augmentation(cfg, torch.device("cpu"))[1],
            torch.device("cpu"),
        )
    )
    next(batches)
    assert cache.filled == 4  # the first step's images only
    for _ in batches:
        pass
    assert cache.filled == len(cache) == 24 and val_set.images.filled == 0
    assert_holds_the_files_decode(cache)


def test_loader_workers_fill_the_memory_the_training_process_reads(tmp_path: Path):
    train, _ = folders(tmp_path)
    cache = SharedImageCache(folder_images(train).table, SIZE, capacity=2**20)
    loader = torch.utils.data.DataLoader(
        cache, batch_size=5, num_workers=2, collate_fn=lambda items: len(items)
    )
    assert sum(loader) == 24  # forked workers decoded and stored every image
    assert cache.filled == 24
    assert_holds_the_files_decode(cache)


def test_images_past_the_capacity_come_from_their_files_alike(tmp_path: Path):
    train, _ = folders(tmp_path, per_class=2)
    table = folder_images(train).table
    side = eval_resize_side(SIZE)
    one = decode_resized(table, 0, side).numel()
    cache = SharedImageCache(table, SIZE, capacity=2 * one)
    for _ in range(2):
        for index in range(len(table)):
            image, label = cache[index]
            assert torch.equal(image, decode_resized(table, index, side))
            assert label == table.label(index)
    assert cache.filled == 2 and cache.nbytes == 2 * one
    assert not cache.keep(0, cache[0][0])  # a filled slot is never written again


def test_a_file_broken_after_the_check_gives_the_next_image(tmp_path: Path, caplog):
    train, _ = folders(tmp_path, per_class=2)
    table = folder_images(train).table
    cache = SharedImageCache(table, SIZE, capacity=2**20)
    cache.states.array[:] = READABLE  # as the check found them
    Path(table.location(0)).write_bytes(b"broken since")
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        image, label = cache[0]
    assert torch.equal(image, decode_resized(table, 1, eval_resize_side(SIZE)))
    assert label == table.label(1) and "using the next image in its place" in caplog.text
    assert cache.cached(0) is None and cache.cached(1) is not None


def test_the_check_processes_end_under_a_training_process_stop_handler():
    """The trainer turns SIGTERM into a stop flag; the check's forked processes must not keep
    it, and their end must not rely on a signal they could handle: with multiprocessing's Pool
    a child that had not yet reset its handlers outlived the pool's SIGTERM, and the start
    waited forever (about 1 in 60 pools on a busy machine). ``ForkedMap`` tells its children
    that the work is done and kills any left; 10 maps here (a map takes about 0.25 s)."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        for _ in range(10):
            done: list = []
            thread = threading.Thread(  # a hang fails, not blocks
                target=lambda out=done: out.append(process_map(abs, [-1, -2, 3], 2)), daemon=True
            )
            thread.start()
            thread.join(60)
            assert not thread.is_alive() and done == [[1, 2, 3]]
    finally:
        signal.signal(signal.SIGTERM, previous)

"""--sampler window: an order that reads whole shards, a function of (seed, epoch, data,
global batch, window) only. Every sample once per epoch for any world size, window and resume
point; each rank reads its own shards; the line a run logs and the bad input it refuses."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest

from conftest import ONE_CPU_PROCESS, data_config, pack_folder, write_image_folder
from imgtrainer.config import parse_config
from imgtrainer.data.host.samplers import WindowSampler
from imgtrainer.data.loaders import build_datasets, build_train_sampler
from imgtrainer.errors import UserError

# 7 shards of unequal sizes (a last short one, as a writer's maxcount leaves), 203 samples.
SIZES = [32, 32, 32, 32, 32, 32, 11]
GROUPS = np.repeat(np.arange(len(SIZES)), SIZES)


def sampler(rank: int, world: int, window: int, global_batch: int = 24, seed: int = 5):
    return WindowSampler(GROUPS, rank, world, seed, global_batch, window=window)


def rank_orders(world: int, window: int, epoch: int, position: int = 0, **kw) -> list[list]:
    orders = []
    for rank in range(world):
        s = sampler(rank, world, window, **kw)
        s.set_epoch(epoch, position)
        orders.append([index for index, _ in s])
    return orders


def steps_of(orders: list[list], share: int) -> list[list]:
    """The global batches: each step, every rank's next ``share`` samples, rank after rank."""
    steps = len(orders[0]) // share
    return [[i for o in orders for i in o[s * share : (s + 1) * share]] for s in range(steps)]


@pytest.mark.parametrize("window", [1, 2, 3, 7])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_sample_once_per_epoch_resumed_anywhere_at_any_world_size(world, window):
    """The epoch's steps do not depend on the number of processes, and a resume at any step
    on another number goes on with the same steps: every sample at most once, all but the
    last partial global batch's worth."""
    whole = steps_of(rank_orders(1, window, epoch=3), 24)
    assert len(whole) == len(GROUPS) // 24
    used = [i for step in whole for i in step]
    assert len(used) == len(set(used)) == len(whole) * 24
    assert steps_of(rank_orders(world, window, epoch=3), 24 // world) == whole
    for stop in range(len(whole)):  # resumed at step ``stop`` on ``world`` processes
        rest = steps_of(rank_orders(world, window, 3, position=stop * 24), 24 // world)
        assert whole[:stop] + rest == whole


def test_a_function_of_seed_and_epoch_mixed_within_the_window():
    first = rank_orders(1, 4, epoch=1)
    assert rank_orders(1, 4, epoch=1) == first
    assert rank_orders(1, 4, epoch=2) != first
    assert rank_orders(1, 4, epoch=1, seed=6) != first
    # Each global batch mixes images of the window's shards, not of one shard.
    for step in steps_of(first, 24):
        assert len(set(GROUPS[step].tolist())) >= 3


def test_each_rank_reads_its_own_shards_a_window_at_a_time():
    """With a window of 4 on 4 processes, each rank reads a quarter of the shards, each of them
    once in the epoch (a shard cut by two ranks' runs is read by both)."""
    orders = rank_orders(4, 4, epoch=0)
    read = [Counter(GROUPS[order].tolist()) for order in orders]
    assert sum(len(r) for r in read) <= len(SIZES) + 3  # at most a cut shard per run boundary
    for order in orders:
        shards = GROUPS[order]
        changes = np.flatnonzero(np.diff(shards)) + 1
        # A shard, once left, never comes back: read whole, then dropped.
        assert len(set(np.split(shards, changes)[k][0] for k in range(len(changes) + 1))) == (
            len(changes) + 1
        )
    # One process, 20 shards: at any point of the epoch about a window of 4 shards is being read
    # (1 in each of its 4 lanes; the random order has all 20 open until its end).
    groups = np.repeat(np.arange(20), 30)
    order = np.asarray(WindowSampler(groups, 0, 1, 5, 24, window=4).indices())
    firsts = {g: np.flatnonzero(groups[order] == g).min() for g in range(20)}
    lasts = {g: np.flatnonzero(groups[order] == g).max() for g in range(20)}
    live = [sum(firsts[g] <= at <= lasts[g] for g in range(20)) for at in range(len(order))]
    assert max(live) <= 5 and np.mean(live) <= 4


def test_a_run_logs_its_order_and_refuses_a_window_larger_than_the_data(tmp_path, caplog):
    folder = write_image_folder(tmp_path / "train", ["a", "b"], 8, seed=1)
    shards = pack_folder(folder, tmp_path / "shards", "tar", shard_size=4)
    cfg = data_config(
        shards, str(folder), sampler="window", log_dir=str(tmp_path / "logs"), batch_size=4
    )
    train, _, classes, check = build_datasets(cfg, ONE_CPU_PROCESS, threads=1)
    check.finish()
    with caplog.at_level(logging.INFO):
        order = build_train_sampler(cfg, train, [8, 8], classes, ONE_CPU_PROCESS)
    assert isinstance(order, WindowSampler) and order.window == 4
    assert "Training order: --sampler window, the images of 4 of 4 groups mixed" in caplog.text
    too_wide = data_config(shards, str(folder), sampler="window", shuffle_window=5)
    with pytest.raises(UserError, match="--shuffle_window 5 is more than the training data's 4"):
        build_train_sampler(too_wide, train, [8, 8], classes, ONE_CPU_PROCESS)
    with pytest.raises(UserError, match="--shuffle_window is a setting of --sampler window"):
        parse_config(["--shuffle_window", "4"])
    # Training data in object storage: the window order unless --sampler says otherwise.
    assert parse_config(["--train_data", "s3://bucket/train-{0..3}.tar"]).sampler == "window"
    given = ["--train_data", "s3://bucket/train.parquet", "--sampler", "random"]
    assert parse_config(given).sampler == "random"

"""Samplers: the training order as a function of (seed, epoch), the evaluation shards."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Sized

import numpy as np
import torch
from torch.utils.data import Sampler

# ----------------------------------------------------------------------------- samplers


class EpochSampler(Sampler):
    """This rank's share of a shuffled epoch, as ``(index, epoch)`` keys; resumable at any
    position of the epoch, on any number of processes.

    The epoch's global order (``epoch_order``) depends on (seed, epoch) only; optimizer step s
    takes its ``global_batch`` consecutive samples from position s x global_batch, rank r
    every world_size-th of them from the r-th (as ``DistributedSampler`` splits an order).
    ``set_epoch(epoch, position)`` continues after ``position`` samples of that order, so a
    run resumed on another number of processes goes on at the same sample; ``set_epoch`` must
    be called before each epoch, otherwise every epoch would see the same order. An epoch is
    ``steps_per_epoch`` whole global batches: a partial last one is left out, like the
    loader's ``drop_last``.
    """

    def __init__(
        self, num_samples: int, rank: int, world_size: int, seed: int, global_batch: int = 0
    ):
        self.dataset_size = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        # One sample per process and step unless told: the steps are then the loader's batches.
        self.global_batch = global_batch or world_size
        if self.global_batch % world_size:
            raise ValueError(f"a global batch of {global_batch} on {world_size} processes")
        self.epoch = 0
        self.position = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch

    def set_epoch(self, epoch: int, position: int = 0) -> None:
        """``epoch``'s order, continuing after its first ``position`` samples."""
        self.epoch = epoch
        self.position = position

    def epoch_order(self) -> list[int]:
        """The epoch's global order, the same on every rank and at every world size: a
        permutation seeded with seed + epoch, padded by repeating its head to at least
        steps_per_epoch x global_batch (a subclass may draw it otherwise, with that length)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.dataset_size, generator=generator).tolist()
        return pad_order(order, self.steps_per_epoch * self.global_batch)

    def indices(self) -> list[int]:
        """This rank's share of the rest of the epoch, from ``position``."""
        end = self.steps_per_epoch * self.global_batch
        return rank_share(self.epoch_order()[:end], self.position, self.rank, self.world_size)

    def rank_order(self, epoch: int) -> list[int]:
        """This rank's share of the whole of ``epoch`` (what its loader reads ahead by,
        and the first images it trains on)."""
        both = self.epoch, self.position
        self.set_epoch(epoch)
        try:
            return self.indices()
        finally:
            self.epoch, self.position = both

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in self.indices():
            yield index, self.epoch

    def __len__(self) -> int:
        end = self.steps_per_epoch * self.global_batch
        return max(0, end - self.position) // self.world_size


def pad_order(order: list[int], length: int) -> list[int]:
    """``order`` repeated from its head up to ``length`` indices (unchanged if long enough)."""
    padding = length - len(order)
    if padding <= 0:
        return order
    return order + (order * math.ceil(padding / max(1, len(order))))[:padding]


def rank_share(order: list[int], position: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s part of ``order`` after its first ``position`` samples: every
    world_size-th from the rank-th. With whole global batches left (a multiple of world_size
    each), each step's global batch is split over the ranks the same way."""
    return order[position + rank :: world_size]


class BalancedClassSampler(EpochSampler):
    """``--sampler balanced``: an epoch of the usual length that draws every class equally
    often (the remainder of len / classes goes to classes drawn at random), whatever their
    sizes. Within a class the images come in a random order, repeated as often as the class's
    share needs: a small class's images are each seen several times, a large class's at most
    once. A function of (seed, epoch) only, like the shuffled order, so a resumed run on any
    number of processes continues the same epoch."""

    def __init__(
        self, targets: Sequence[int], rank: int, world_size: int, seed: int, global_batch: int = 0
    ):
        super().__init__(len(targets), rank, world_size, seed, global_batch)
        by_class: dict[int, list[int]] = {}
        for index, target in enumerate(targets):
            by_class.setdefault(int(target), []).append(index)
        self.by_class = [by_class[c] for c in sorted(by_class)]

    def epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        classes = len(self.by_class)
        share, extra = divmod(self.dataset_size, classes)
        lucky = set(torch.randperm(classes, generator=generator)[:extra].tolist())
        drawn: list[int] = []
        for c, members in enumerate(self.by_class):
            wanted = share + (c in lucky)
            while wanted > 0:  # a fresh random order of the class for each pass over it
                take = min(wanted, len(members))
                shuffled = torch.randperm(len(members), generator=generator)[:take].tolist()
                drawn += [members[i] for i in shuffled]
                wanted -= take
        mixed = torch.randperm(len(drawn), generator=generator).tolist()
        return [drawn[i] for i in mixed]


DEFAULT_WINDOW = 16  # --shuffle_window when not given (at most the data's groups)


class WindowSampler(EpochSampler):
    """``--sampler window``: an order that reads whole shards (``groups[i]``: row i's shard,
    Parquet row group or group of rows, numbered from 0), a function of (seed, epoch, groups, global batch,
    ``window``) only, so a resume at any step and any world size continues it exactly.

    The groups are drawn in a seeded order, laid end to end and cut into ``lanes`` equal runs
    (the largest divisor of the global batch not above ``window``); each run's samples are
    shuffled within every ``ceil(window / lanes)`` consecutive groups of it. Each global batch
    takes the next global_batch / lanes samples of every lane, lane after lane, and rank r the
    r-th contiguous block of it: a rank reads its own lanes' groups, about ``window`` groups are
    read at any time, and each batch mixes samples of all of them. Every sample once per epoch
    (the last partial global batch's worth of the order left out, as the loader's drop_last)."""

    def __init__(
        self, groups: Sequence[int], rank: int, world_size: int, seed: int, global_batch: int = 0,
        window: int = DEFAULT_WINDOW,
    ):  # fmt: skip
        super().__init__(len(groups), rank, world_size, seed, global_batch)
        self.group = np.asarray(groups, dtype=np.int64)  # numbered from 0 (``table.groups``)
        self.num_groups = int(self.group.max()) + 1 if len(self.group) else 0
        self.window = window
        self.lanes = max(d for d in range(1, window + 1) if self.global_batch % d == 0)
        self.lane_groups = -(-window // self.lanes)
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its order): built once

    @property
    def read_ahead(self) -> int:
        """Samples of this rank's order whose groups its loader fetches ahead: its share of the
        next window of every lane, read while the current one is."""
        per_group = self.dataset_size / max(1, self.num_groups)
        return math.ceil(self.lane_groups * per_group * self.lanes / self.world_size)

    def epoch_order(self) -> list[int]:
        return self.order_array().tolist()

    def order_array(self) -> np.ndarray:
        """The epoch's order (``epoch_order``) as an array, built once per epoch: the loader,
        its read-ahead and the preview each ask for it."""
        if self._order is None or self._order[0] != self.epoch:
            self._order = self.epoch, self._build_order()
        return self._order[1]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_order": None}  # a spawned worker builds its own

    def _build_order(self) -> np.ndarray:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        place = np.argsort(torch.randperm(self.num_groups, generator=generator).numpy())
        total = self.steps_per_epoch * self.global_batch
        rows = np.lexsort((np.arange(self.dataset_size), place[self.group]))[:total]
        per_lane = total // self.lanes
        lane = np.arange(total) // per_lane
        group = self.group[rows]
        # A new piece where the group or the lane changes: a group cut by a lane's end is read
        # by both lanes.
        starts = np.ones(total, dtype=bool)
        starts[1:] = (group[1:] != group[:-1]) | (lane[1:] != lane[:-1])
        piece = np.cumsum(starts) - 1
        window = (piece - piece[lane * per_lane]) // self.lane_groups
        keys = torch.randperm(total, generator=generator).numpy()
        lanes = rows[np.lexsort((keys, window, lane))].reshape(self.lanes, self.steps_per_epoch, -1)
        return lanes.transpose(1, 0, 2).reshape(-1)

    def indices(self) -> list[int]:
        if self.position % self.global_batch:
            raise ValueError(f"position {self.position} is not a step's start")
        share = self.global_batch // self.world_size
        batches = self.order_array().reshape(-1, self.global_batch)
        block = batches[self.position // self.global_batch :, self.rank * share :]
        return block[:, :share].reshape(-1).tolist()


class ShardSampler(Sampler):
    """Every world_size-th index from ``rank``, without padding: each validation image is seen by
    exactly one rank, so metrics summed over ranks count it exactly once. ``samples``: their
    number, or a dataset whose length is read each time (it may shrink once its unreadable
    images are known)."""

    def __init__(self, samples: int | Sized, rank: int, world_size: int):
        self.samples, self.rank, self.world_size = samples, rank, world_size

    @property
    def shard(self) -> range:
        n = self.samples if isinstance(self.samples, int) else len(self.samples)
        return range(self.rank, n, self.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard)

    def rank_order(self, epoch: int) -> list[int]:
        """This rank's indices (the same every epoch), for its loader to read ahead by."""
        return list(self.shard)

    def __len__(self) -> int:
        return len(self.shard)

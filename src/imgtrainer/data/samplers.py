"""Samplers: the training order as a function of (seed, epoch), the evaluation shards."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

# ----------------------------------------------------------------------------- samplers


class EpochSampler(Sampler):
    """This rank's share of a shuffled epoch, as ``(index, epoch)`` keys; resumable by position.

    Like ``DistributedSampler``: the permutation is drawn from a generator seeded with
    seed + epoch (identical on every rank), padded by repeating its head so it divides evenly,
    and rank r takes every world_size-th index. ``set_epoch`` must be called before each epoch,
    otherwise every epoch would see the same order. ``start`` skips the first samples of this
    rank's share by index, without loading them, to continue a run in the middle of an epoch.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int, seed: int):
        self.dataset_size = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.per_rank = math.ceil(num_samples / world_size)
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start

    def epoch_order(self) -> list[int]:
        """The epoch's order over the whole dataset, the same on every rank."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def indices(self) -> list[int]:
        order = self.epoch_order()
        padding = self.per_rank * self.world_size - self.dataset_size
        order += (order * math.ceil(padding / max(1, len(order))))[:padding]
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in self.indices()[self.start :]:
            yield index, self.epoch

    def __len__(self) -> int:
        return self.per_rank - self.start


class BalancedClassSampler(EpochSampler):
    """``--sampler balanced``: an epoch of the usual length that draws every class equally
    often (the remainder of len / classes goes to classes drawn at random), whatever their
    sizes. Within a class the images come in a random order, repeated as often as the class's
    share needs: a small class's images are each seen several times, a large class's at most
    once. A function of (seed, epoch) only, like the shuffled order, so a resumed run on any
    number of processes continues the same epoch."""

    def __init__(self, targets: Sequence[int], rank: int, world_size: int, seed: int):
        super().__init__(len(targets), rank, world_size, seed)
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


class ShardSampler(Sampler):
    """Every world_size-th index from ``rank``, without padding: each validation image is seen by
    exactly one rank, so metrics summed over ranks count it exactly once."""

    def __init__(self, num_samples: int, rank: int, world_size: int):
        self.shard = range(rank, num_samples, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard)

    def __len__(self) -> int:
        return len(self.shard)

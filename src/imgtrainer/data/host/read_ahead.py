"""Object-store reads in a loader worker: shards fetched whole ahead; lone requests in threads.

In the order of ``--sampler window``, the shards the rank needs next are fetched whole ahead of
need. The order is a function of (seed, epoch, data), so each worker knows from a batch's keys where
its rank is in the epoch and which groups (shards, Parquet row groups) come next; the node's
processes share the fetched bytes through the store's cache and its claims. A batch whose groups
the cache holds is read there as from a disk, in the worker's own thread.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from torch.utils.data import Dataset, Sampler

from imgtrainer.data.layouts.table import ImageTable

READ_AHEAD = 16  # samples a loader worker reads at once from an object store
FETCHES = 8  # groups a loader worker fetches at once


def remote_table(dataset: Dataset) -> ImageTable | None:
    """The table of ``dataset``'s images when they are read from an object store (not those of
    the GPU cache, decoded up front), else None."""
    for _ in range(4):  # the table under its wrappers: samples, checked rows, the RAM cache
        table = getattr(dataset, "table", None)
        if table is not None:
            return table if table.remote else None
        dataset = getattr(dataset, "images", None) or getattr(dataset, "dataset", None)
        if dataset is None:
            return None
    return None


class ReadAhead(Dataset):
    """A dataset whose samples read objects one request each, read a loader batch at a time
    in ``READ_AHEAD`` threads of the worker: the batch waits about one round trip per
    ``READ_AHEAD`` samples, not one per sample. Each sample is the same as read alone (its
    draws are seeded by its key), in the same order.

    With ``order`` (a sampler that reads in groups: ``rank_order(epoch)``, the rank's indices,
    and ``read_ahead``), the groups of ``table`` (shards, row groups) of the batch and of the
    rank's next ``read_ahead`` samples are first fetched into the store's cache, ``FETCHES`` at
    once, and the batch's own waited for: its samples are then read there, one after another
    (threads would only add their cost to a read from the disk)."""

    def __init__(self, dataset: Dataset, table: ImageTable, order: Sampler | None = None):
        self.dataset, self.table, self.order = dataset, table, order
        self.worker: _Worker | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        return self.dataset[key]

    def __getitems__(self, keys: list) -> list:
        if self.worker is None or self.worker.pid != os.getpid():  # a worker's own threads
            self.worker = _Worker(os.getpid())
        if self.order is not None and keys and len(self.dataset) == len(self.table):
            # (rows left out: an order of its own) Held in the cache: read as from a disk.
            if self.worker.fetch(self.table, self.order, keys):
                return [self.dataset[key] for key in keys]
        return list(self.worker.reads.map(self.dataset.__getitem__, keys))

    def __getattr__(self, name: str):
        if name == "dataset":  # not set yet (being copied): never recurse
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "worker": None}  # threads are a process's own


@dataclass
class _Worker:
    """One process's threads, and where its rank is in the epoch's order."""

    pid: int
    reads: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(READ_AHEAD))
    fetches: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(FETCHES))
    epoch: int = -1
    where: np.ndarray | None = None  # each index's position in the rank's order (-1: none)
    upcoming: np.ndarray | None = None  # the rank's order of groups, one per sample
    last: np.ndarray | None = None  # each group's last position in the rank's order
    read_ahead: int = 0  # samples of the rank's order whose groups are fetched ahead
    pending: dict[int, Future] = field(default_factory=dict)  # group -> its fetch's URLs
    done: dict[int, list[str]] = field(default_factory=dict)  # fetched this epoch -> URLs

    def fetch(self, table: ImageTable, order: Sampler, keys: list) -> bool:
        """Fetch what ``keys`` (a batch: ``(index, epoch)`` or indices) and the rank's next
        samples read, and wait for the batch's groups; whether the cache holds them all. One
        line for a group that cannot be fetched."""
        first, epoch = keys[0] if isinstance(keys[0], tuple) else (keys[0], 0)
        if epoch != self.epoch:
            self.start_epoch(table, order, epoch)
        at = int(self.where[first])
        if at < 0:
            return False  # not of this order
        ahead = self.upcoming[at : at + len(keys) + self.read_ahead]
        groups = ahead[np.sort(np.unique(ahead, return_index=True)[1])]
        for group in groups.tolist():
            if group not in self.pending and group not in self.done:
                self.pending[group] = self.fetches.submit(table.hold_group, int(group))
        held = True
        for group in np.unique(self.upcoming[at : at + len(keys)]).tolist():
            if group in self.pending:
                self.done[group] = self.pending.pop(group).result()
            held = held and bool(self.done.get(group))
        self.retire(table, at)
        return held

    def start_epoch(self, table: ImageTable, order: Sampler, epoch: int) -> None:
        group, count = table.groups(), table.num_groups
        self.read_ahead = getattr(order, "read_ahead", None) or 2 * len(table) // count
        ranks = np.asarray(order.rank_order(epoch), dtype=np.int64)
        self.where = np.full(len(table), -1, dtype=np.int64)
        self.where[ranks] = np.arange(len(ranks))
        self.upcoming = group[ranks]
        self.last = np.full(count, -1, dtype=np.int64)
        np.maximum.at(self.last, self.upcoming, np.arange(len(ranks)))
        self.epoch, self.done = epoch, {}  # the cache may have dropped last epoch's

    def retire(self, table: ImageTable, at: int) -> None:
        """Objects of groups the rank's order has passed (and no group to come) go first when
        the cache is trimmed."""
        passed = [g for g in self.done if self.last[g] < at]
        if not passed:
            return
        needed = {url for g, urls in self.done.items() if self.last[g] >= at for url in urls}
        for group in passed:
            for url in set(self.done.pop(group)) - needed:
                table.store.retire(url)

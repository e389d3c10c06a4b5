"""Unreadable images: found by a decode check that runs beside training (in parallel,
remembered between runs), reported once, left out.

Training does not wait for the check. Until it is done, an image that does not decode gives the
next one in its place (``table.ReadStates``), as it does once it is known: the images a run
trains on never depend on how far the check has got. The ranks gather its results at the end of
the first epoch (``DecodeCheck.finish``), before the first validation, which leaves the
unreadable validation images out (``CheckedRows``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from imgtrainer import heartbeat
from imgtrainer.data.layouts.folder_checks import refuse_empty_classes
from imgtrainer.data.layouts.image_files import PARALLEL_MIN_FILES, write_unreadable_list
from imgtrainer.data.layouts.table import READABLE, UNKNOWN, UNREADABLE, ImageTable, TableImages
from imgtrainer.distributed.collectives import all_gather_objects
from imgtrainer.errors import UserError, first_line
from imgtrainer.files import atomic_write
from imgtrainer.process import ForkedMap, TorchrunEnv

log = logging.getLogger(__name__)

CHUNK = 512  # images a forked process checks per task
REMOTE_READS = 16  # images of an object store a process checks at once


class DecodeCheck:
    """The decode check of some datasets (``{role: TableImages}``), started here in the
    background. Forked processes, on CPU time that training leaves (``ForkedMap``), read
    the size and modification time of every image's file, and decode (at 1/8 scale, JPEG's
    DCT scaling: every byte is still read and entropy-decoded) this rank's share of them,
    every ``world_size``-th, less those whose result ``cache_dir`` remembers for an unchanged
    file (a few hundred images: a thread of this process does it). Results go into each
    dataset's ``states`` as they come. ``finish`` waits for the
    rest and gathers the ranks' results. Every rank must make one and call ``finish`` at the
    same point; ``close`` ends the processes of a run that ends before.
    """

    def __init__(
        self,
        images: dict[str, TableImages],
        log_dir: Path | None,
        rank: int = 0,
        world_size: int = 1,
        cache_dir: Path | None = None,
        workers: int | None = None,
    ):
        self.images, self.log_dir = images, log_dir
        self.rank, self.world_size = rank, world_size
        self.tables = {role: dataset.table for role, dataset in images.items()}
        self.cache = DecodeCheckCache(cache_dir, self.tables)
        self.stats = {role: np.full((len(t), 2), -1, np.int64) for role, t in self.tables.items()}
        self.problems: dict[str, dict[int, str]] = {role: {} for role in self.tables}
        self.views: dict[str, CheckedRows] = {}
        self.unreadable: dict[str, str] | None = None  # {location: why}, once finished
        tasks = [
            (role, start, min(start + CHUNK, len(table)))
            for role, table in self.tables.items()
            for start in range(0, len(table), CHUNK)
        ]
        self.pool, self.error, self.collected, self.thread = None, None, 0, None
        if not tasks:
            return
        if sum(map(len, self.tables.values())) < PARALLEL_MIN_FILES:
            # A few images: the thread checks them itself, no processes are worth starting.
            results = ((role, start, *self.rows(role, start, stop)) for role, start, stop in tasks)
        else:
            self.pool = ForkedMap(
                self._task_rows,
                tasks,
                workers or torch.get_num_threads(),
                background=True,
                start=_open_check_slot,
            )
            results = (result for _, result in self.pool.results())
        self.thread = threading.Thread(target=self._collect, args=(results,), daemon=True)
        self.thread.start()

    def _collect(self, results) -> None:
        """Each task's results into the datasets' states, as they come (no logging here: the
        loader workers are forked while this thread runs). A process of the pool that ends
        before its result (the out-of-memory killer, a signal) leaves its task to this
        thread (``ForkedMap``); ``wait`` says so."""
        try:
            for role, start, stats, checked, problems in results:
                self.stats[role][start : start + len(stats)] = stats
                self.problems[role].update(problems)
                states = self.images[role].states.array[start : start + len(stats)]
                states[checked & (states == UNKNOWN)] = READABLE
                states[[i - start for i in problems]] = UNREADABLE
                self.collected += 1
        except Exception as err:  # raised again by finish, in the training process's thread
            self.error = err
        if self.pool is not None:
            self.pool.close()  # no process idles once the work is done

    def _task_rows(self, task: tuple[str, int, int]) -> tuple:
        role, start, stop = task
        return (role, start, *self.rows(role, start, stop))

    def close(self) -> None:
        """End the check's processes now (the run ends; ``finish`` may never come)."""
        if self.pool is not None:
            self.pool.close()

    def rows(self, role: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """In a forked process: the stats of rows ``start:stop``, which of them this rank
        knows the result of (remembered, or checked now), and ``{row: why}`` of those that do
        not decode."""
        table = self.tables[role]
        stats = row_stats(table, start, stop)
        saved = self.cache.saved(role, start, stop)
        known = (saved == stats).all(axis=1) if saved is not None else np.zeros(len(stats), bool)
        mine = (np.arange(start, stop) % self.world_size) == self.rank
        problems = {i: self.cache.problem(role, i) for i in range(start, stop) if known[i - start]}
        checked = [i for i in range(start, stop) if mine[i - start] and not known[i - start]]
        # Remote: whole shards into the cache first, then read there as from a disk; where the
        # cache cannot hold them, each image is a request: many at once.
        fetched = _fetched(table, checked) if table.remote else []
        if table.remote and not fetched:
            with ThreadPoolExecutor(REMOTE_READS) as pool:
                problems.update(zip(checked, pool.map(table.problem, checked), strict=True))
        else:
            problems.update((i, table.problem(i)) for i in checked)
        for url in fetched:  # the first the cache drops: training reads in its own order
            table.store.retire(url)
        problems = {i: why for i, why in problems.items() if why is not None}
        return stats, known | mine, problems

    def readable(self, role: str, dataset: Dataset) -> CheckedRows:
        """``dataset`` (of the ``role`` images) less the images found unreadable, once the
        check is finished; all of them until then."""
        self.views[role] = view = CheckedRows(dataset)
        if self.unreadable is not None:
            view.keep(self.readable_rows(role))
        return view

    def finish(self) -> dict[str, str]:
        """Wait for this rank's share, gather every rank's results so that all know every
        unreadable image, remember them, report them in one warning (the list goes to
        ``log_dir``), and refuse a class left without readable images. ``{location: why}``.
        Every rank must call this at the same point; later calls return the same."""
        if self.unreadable is not None:
            return self.unreadable
        self.wait()
        found = gather_unreadable(self.problems, self.world_size)
        self.problems = found
        self.cache.remember(self.stats, found)
        self.unreadable = settle_unreadable(self.tables, found, self.log_dir)
        for role in self.tables:
            states = self.images[role].states.array
            states[states == UNKNOWN] = READABLE
            states[list(found[role])] = UNREADABLE
            if role in self.views:
                self.views[role].keep(self.readable_rows(role))
        return self.unreadable

    def wait(self) -> None:
        """Wait for this rank's share of the check, ticking the hang watchdog's heartbeat as
        results come (a check of a million images may take minutes)."""
        if self.thread is not None:
            heartbeat.mark(heartbeat.Phase.DATA_CHECK)
            seen = -1
            while self.thread.is_alive():
                if self.collected != seen:
                    seen = self.collected
                    heartbeat.tick()
                self.thread.join(1.0)
        if self.error is not None:
            # A bug (its traceback follows): one line that says where it happened.
            raise RuntimeError(f"the images' decode check failed: {first_line(self.error)}") from (
                self.error
            )
        lost = self.pool.lost if self.pool is not None else []
        for pid, code in lost:
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            log.warning(
                f"a process of the images' decode check (pid {pid}) ended early ({how}): "
                "this process checked its share"
            )
        lost.clear()  # said once

    def readable_rows(self, role: str) -> np.ndarray:
        keep = np.ones(len(self.tables[role]), bool)
        keep[list(self.problems[role])] = False
        return np.flatnonzero(keep)


def _fetched(table: ImageTable, rows: list[int]) -> list[str]:
    """``table.fetch_groups(rows)``; none when that fails: each image then names its problem."""
    try:
        return table.fetch_groups(rows) if rows else []
    except Exception:  # gone or cut short: the reads say which images
        return []


def _open_check_slot(number: int) -> None:
    """In a forked process of the check: a heartbeat slot of its own, so that the launcher's
    hang watchdog can name it when its rank waits for the check's end. Its reads are not
    marked: it runs on CPU time that training leaves, and may wait for it long."""
    env = TorchrunEnv.read()
    heartbeat.open_slot(env.rank, env.restart_count, number, heartbeat.CHECK_PROCESS)


def leave_out_unreadable(
    images: dict[str, TableImages],
    log_dir: Path | None,
    rank: int = 0,
    world_size: int = 1,
    cache_dir: Path | None = None,
) -> dict[str, str]:
    """The decode check, waited for: the unreadable images left out of ``images`` (one
    warning, the list in ``log_dir``; an error for a class left without images);
    ``{location: why}``. Every rank must call this."""
    unreadable = DecodeCheck(images, log_dir, rank, world_size, cache_dir).finish()
    for dataset in images.values():
        dataset.leave_out(unreadable)
    return unreadable


def gather_unreadable(
    found: dict[str, dict[int, str]], world_size: int
) -> dict[str, dict[int, str]]:
    """Every rank's ``{role: {row: why}}`` of unreadable images merged: a file that fails on
    one rank is left out on all of them (the ranks must shuffle the same dataset). Every rank
    must call this."""
    parts = all_gather_objects(found) if world_size > 1 else [found]
    merged: dict[str, dict[int, str]] = {role: {} for role in found}
    for part in parts:
        for role, problems in part.items():
            merged[role].update(problems)
    return merged


def settle_unreadable(
    tables: dict[str, ImageTable], found: dict[str, dict[int, str]], log_dir: Path | None
) -> dict[str, str]:
    """Report the unreadable images of ``tables`` (``{role: {row: why}}``, every rank's) in
    one warning, their list in ``log_dir``, and refuse a class left without a readable image;
    ``{location: why}``."""
    unreadable = {
        tables[role].location(i): why
        for role, problems in found.items()
        for i, why in sorted(problems.items())
    }
    if unreadable:
        report_unreadable(unreadable, sum(map(len, tables.values())), log_dir)
    for role, table in tables.items():
        readable = np.setdiff1d(np.arange(len(table)), np.fromiter(found[role], np.int64))
        refuse_empty_classes(table.source, table.empty_classes(readable), role, readable=True)
    return unreadable


class CheckedRows(Dataset):
    """The rows ``rows`` of ``dataset`` (all of them until ``keep`` says which), a dataset
    itself: the validation images less those that do not decode."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.rows = np.arange(len(dataset))

    def keep(self, rows: np.ndarray) -> None:
        self.rows = rows

    @property
    def targets(self) -> np.ndarray:
        return np.asarray(self.dataset.targets)[self.rows]

    @property
    def classes(self) -> list[str]:
        return self.dataset.classes

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        return self.dataset[int(self.rows[index])]

    def __getattr__(self, name: str):
        """Anything else is the dataset's (a cache's fill level, its table)."""
        if name == "dataset":  # not set yet (being copied): never recurse
            raise AttributeError(name)
        return getattr(self.dataset, name)


def row_stats(table: ImageTable, start: int, stop: int) -> np.ndarray:
    """(size, modification time in ns) of the file of each row ``start:stop`` (the image
    file, or its shard or Parquet file, each stat'ed once; an object's version as listed),
    (-1, -1) where it cannot be read."""
    out = np.full((stop - start, 2), -1, dtype=np.int64)
    seen: dict[str, tuple[int, int]] = {}  # a shard's or Parquet file's, stat'ed once
    for i in range(start, stop):
        file = table.file_of(i)
        if file not in seen:
            try:
                seen[file] = table.store.stat(file)  # an object's: its size and version
            except OSError:
                seen[file] = -1, -1
        out[i - start] = seen[file]
    return out


def fingerprint(table: ImageTable) -> str:
    """A digest of which images a table holds, in which order: the cache's results by row
    apply to a table with the same digest only."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps([table.kind.name, table.column, table.containers]).encode())
    for array in (table.container, table.members.data, table.members.ends, table.offsets):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


class DecodeCheckCache:
    """What the decode check found, per dataset (by role) and row, with the size and
    modification time of each row's file (``row_stats``), kept in
    ``folder/image_check_cache.npz`` as arrays, so a restart neither decodes every image again
    nor builds a Python object per image to know it. The rows apply to a dataset that lists
    the same images in the same order (``fingerprint``); a file that changes gets a new size or
    time and its images are checked again.

    It lives in the run's log folder, which is writable by definition (a dataset may sit on a
    read-only share) and goes away with the run's logs. Every rank writes the same content,
    through its own temporary file renamed into place, like the unreadable-images list.
    Without a folder it remembers nothing.
    """

    NAME = "image_check_cache.npz"
    VERSION = 3  # bump when the check itself changes: old results are then ignored

    def __init__(self, folder: Path | None, tables: dict[str, ImageTable]):
        self.folder = folder
        self.prints = {role: fingerprint(table) for role, table in tables.items()}
        self.stats: dict[str, np.ndarray] = {}  # by role, for the tables listed as saved
        self.problems: dict[str, dict[int, str]] = {}
        if folder is None:
            return
        try:
            with np.load(folder / self.NAME) as saved:
                if int(saved["version"]) != self.VERSION:
                    return
                prints = json.loads(saved["prints"].tobytes())
                problems = json.loads(saved["problems"].tobytes())
                for role, mark in self.prints.items():
                    if prints.get(role) == mark:
                        self.stats[role] = saved[f"stats_{role}"]
                        self.problems[role] = {int(i): why for i, why in problems[role].items()}
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
            self.stats, self.problems = {}, {}  # no cache yet, or a damaged one: check again

    def saved(self, role: str, start: int, stop: int) -> np.ndarray | None:
        """The remembered stats of rows ``start:stop``; None when the dataset is new."""
        stats = self.stats.get(role)
        return None if stats is None else stats[start:stop]

    def problem(self, role: str, i: int) -> str | None:
        return self.problems.get(role, {}).get(i)

    def remember(self, stats: dict[str, np.ndarray], problems: dict[str, dict[int, str]]):
        """Keep ``stats`` and ``problems`` of every row, by role (all rows checked)."""
        if self.folder is None:
            return
        arrays = {f"stats_{role}": rows for role, rows in stats.items()}
        text = {role: {str(i): why for i, why in found.items()} for role, found in problems.items()}
        arrays |= {
            "version": np.array(self.VERSION),
            "prints": np.frombuffer(json.dumps(self.prints).encode(), dtype=np.uint8),
            "problems": np.frombuffer(json.dumps(text).encode(), dtype=np.uint8),
        }
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            size = sum(a.nbytes for a in arrays.values())
            atomic_write(self.folder / self.NAME, lambda f: np.savez(f, **arrays), lambda: size)
        except (OSError, UserError) as err:  # only a cache: the next start checks again
            log.warning(f"could not write {self.folder / self.NAME} ({err})")


def report_unreadable(unreadable: dict[str, str], total: int, log_dir: Path | None) -> None:
    if log_dir is not None:
        where = f"list in {write_unreadable_list(unreadable, log_dir)}"
    else:
        shown = sorted(unreadable)[:3]
        where = ", ".join(shown) + (", ..." if len(unreadable) > len(shown) else "")
    log.warning(
        f"{len(unreadable)} of {total} image files cannot be decoded and are left out ({where})"
    )

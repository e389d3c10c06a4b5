"""Unreadable images: found once (in parallel, remembered between runs), reported, left out."""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from imgtrainer.data.checks import refuse_empty_classes
from imgtrainer.data.image_files import (
    PARALLEL_MIN_FILES,
    find_unreadable,
    process_map,
    write_unreadable_list,
)
from imgtrainer.data.table import ImageTable, TableImages
from imgtrainer.distributed.collectives import all_gather_objects
from imgtrainer.errors import UserError
from imgtrainer.files import atomic_write

log = logging.getLogger(__name__)


def leave_out_unreadable(
    folders: dict[str, TableImages],
    log_dir: Path | None,
    rank: int = 0,
    world_size: int = 1,
    cache_dir: Path | None = None,
) -> dict[str, str]:
    """Find the images that do not decode, leave them out with one warning (the list goes to
    ``log_dir``), then refuse a class left without images; returns ``{location: reason}``
    of the images left out. With ``cache_dir``, results are remembered there per image (see
    ``DecodeCheckCache``). Every rank must call this."""
    entries = TableEntries([folder.table for folder in folders.values()])
    unreadable = find_unreadable_shared(entries, rank, world_size, cache_dir)
    if unreadable:
        report_unreadable(unreadable, len(entries.locations), log_dir)
    for role, folder in folders.items():
        folder.leave_out(unreadable)
        check_no_empty_class(folder, role)
    return unreadable


class TableEntries:
    """Every image of some tables by its location, for the decode check: where each is, and
    the file standing for it (its own, or its shard's)."""

    def __init__(self, tables: list[ImageTable]):
        self.where = {table.location(i): (table, i) for table in tables for i in range(len(table))}
        self.locations = list(self.where)

    def file_of(self, location: str) -> str:
        table, i = self.where[location]
        return table.file_of(i)

    def problem(self, location: str) -> str | None:
        table, i = self.where[location]
        return table.problem(i)


def find_unreadable_shared(
    entries: TableEntries, rank: int, world_size: int, cache_dir: Path | None = None
) -> dict[str, str]:
    """Each rank checks every world_size-th image, in its share of the cores (torch's thread
    count, which distributed.setup_distributed sets); the results are gathered so that every
    rank leaves out exactly the same images: the samplers index the same list on every rank.
    Images whose result ``cache_dir`` remembers are not decoded again."""
    workers = torch.get_num_threads()
    cache = DecodeCheckCache(cache_dir, entries.file_of)
    todo = cache.unknown(entries.locations, workers)
    if world_size > 1:
        # Ranks on other nodes may remember other files (their own log folder): check every file
        # that any rank lacks, so each rank learns every result and the shares line up.
        todo = sorted(set().union(*all_gather_objects(todo)))
    found = find_unreadable(todo[rank::world_size], workers, entries.problem)
    if world_size > 1:
        found = {path: why for part in all_gather_objects(found) for path, why in part.items()}
    if todo:
        cache.remember(todo, found)
    return {loc: why for loc in entries.locations if (why := cache.problem(loc)) is not None}


def file_stats(paths: list[str], workers: int = 1) -> np.ndarray:
    """(size, modification time in ns) of each path, (-1, -1) for one that cannot be read, in
    ``workers`` forked processes for long lists (a stat is mostly Python's own work)."""
    if workers > 1 and len(paths) >= 8 * PARALLEL_MIN_FILES:
        step = -(-len(paths) // (4 * workers))
        chunks = [paths[i : i + step] for i in range(0, len(paths), step)]
        parts = process_map(_stats, chunks, workers)
        return np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
    return _stats(paths)


def _stats(paths: list[str]) -> np.ndarray:
    out = np.full((len(paths), 2), -1, dtype=np.int64)
    for i, path in enumerate(paths):
        try:
            st = os.stat(path)
        except OSError:
            continue
        out[i] = st.st_size, st.st_mtime_ns
    return out


def location_stats(
    locations: list[str], file_of: Callable[[str], str] = str, workers: int = 1
) -> np.ndarray:
    """``file_stats`` of the file of each location (an image file, or the shard or Parquet file
    holding it), each file stat'ed once."""
    if file_of is str:
        return file_stats(locations, workers)
    files = [file_of(location) for location in locations]
    unique = list(dict.fromkeys(files))
    stats = file_stats(unique, workers)
    at = {path: i for i, path in enumerate(unique)}
    return stats[np.array([at[path] for path in files], dtype=np.int64)].reshape(-1, 2)


class DecodeCheckCache:
    """What the decode check found for each image, keyed by its location and the size and
    modification time of its file (``file_of``: the image file, or its shard or Parquet file),
    kept in ``folder/image_check_cache.npz`` as arrays (the locations one blob, sizes and times
    one array, the few problems apart), so a start neither decodes every image again nor builds
    a Python object per image to know it; a file that changes gets a new size or time and its
    images are checked again. It remembers the images of its last check.

    It lives in the run's log folder, which is writable by definition (a dataset may sit on a
    read-only share) and goes away with the run's logs. Every rank writes the same content,
    through its own temporary file renamed into place, like the unreadable-files list. Without a
    folder it remembers nothing.
    """

    NAME = "image_check_cache.npz"
    VERSION = 2  # bump when the check itself changes: old results are then ignored

    def __init__(self, folder: Path | None, file_of: Callable[[str], str] = str):
        self.folder, self.file_of = folder, file_of
        self.blob, self.saved = b"", np.zeros((0, 2), np.int64)  # the remembered images
        self.problems: dict[str, str] = {}
        self.paths: list[str] = []
        self.stats = np.zeros((0, 2), np.int64)  # of ``paths``, the images asked about
        if folder is None:
            return
        try:
            with np.load(folder / self.NAME) as saved:
                if int(saved["version"]) == self.VERSION:
                    self.blob, self.saved = saved["paths"].tobytes(), saved["stats"]
                    self.problems = json.loads(saved["problems"].tobytes())
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
            self.blob, self.problems = b"", {}  # no cache yet, or a damaged one: check again

    def unknown(self, paths: list[str], workers: int = 1) -> list[str]:
        """The images of ``paths`` (locations) whose result is not remembered (new, changed,
        never checked)."""
        self.paths, self.stats = list(paths), location_stats(paths, self.file_of, workers)
        if self.folder is None or not self.blob:
            return list(paths)
        if _joined(paths) == self.blob:  # the same files as last time: compare the arrays
            known = (self.saved == self.stats).all(axis=1)
        else:
            names = self.blob.decode("utf-8", "surrogateescape").split("\0")
            at = {name: i for i, name in enumerate(names)}
            index = np.array([at.get(p, -1) for p in paths], dtype=np.int64)
            known = (index >= 0) & (self.saved[index] == self.stats).all(axis=1)
        position = {p: i for i, p in enumerate(paths) if p in self.problems}
        self.problems = {p: self.problems[p] for p, i in position.items() if known[i]}
        return [p for p, ok in zip(paths, known, strict=True) if not ok]

    def remember(self, checked: list[str], problems: dict[str, str]) -> None:
        """Keep the results of ``checked`` (files of the last ``unknown`` list) with the
        still-valid ones, for that whole list."""
        if not self.paths:  # not asked through unknown(): remember these images alone
            self.paths, self.stats = list(checked), location_stats(checked, self.file_of)
        self.problems.update(problems)
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            arrays = {
                "version": np.array(self.VERSION),
                "paths": np.frombuffer(_joined(self.paths), dtype=np.uint8),
                "stats": self.stats,
                "problems": np.frombuffer(json.dumps(self.problems).encode(), dtype=np.uint8),
            }
            tmp = self.folder / f".{self.NAME}.{os.getpid()}.tmp"
            size = sum(a.nbytes for a in arrays.values())
            atomic_write(
                self.folder / self.NAME, lambda f: np.savez(f, **arrays), lambda: size, tmp=tmp
            )
        except (OSError, UserError) as err:  # only a cache: the next start checks again
            log.warning(f"could not write {self.folder / self.NAME} ({err})")

    def problem(self, path: str) -> str | None:
        return self.problems.get(path)


def _joined(paths: list[str]) -> bytes:
    return "\0".join(paths).encode("utf-8", "surrogateescape")


def report_unreadable(unreadable: dict[str, str], total: int, log_dir: Path | None) -> None:
    if log_dir is not None:
        where = f"list in {write_unreadable_list(unreadable, log_dir)}"
    else:
        shown = sorted(unreadable)[:3]
        where = ", ".join(shown) + (", ..." if len(unreadable) > len(shown) else "")
    log.warning(
        f"{len(unreadable)} of {total} image files cannot be decoded and are left out ({where})"
    )


def check_no_empty_class(folder: TableImages, role: str) -> None:
    refuse_empty_classes(folder.root, folder.empty_classes(), role, readable=True)

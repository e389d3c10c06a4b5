"""Unreadable images: found once (in parallel, remembered between runs), reported, left out."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from imgtrainer.data.checks import refuse_empty_classes
from imgtrainer.data.image_files import find_unreadable, write_unreadable_list
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
    cache = DecodeCheckCache(cache_dir, entries.file_of)
    todo = cache.unknown(entries.locations)
    if world_size > 1:
        # Ranks on other nodes may remember other files (their own log folder): check every file
        # that any rank lacks, so each rank learns every result and the shares line up.
        todo = sorted(set().union(*all_gather_objects(todo)))
    found = find_unreadable(todo[rank::world_size], torch.get_num_threads(), entries.problem)
    if world_size > 1:
        found = {path: why for part in all_gather_objects(found) for path, why in part.items()}
    if todo:
        cache.remember(todo, found)
    return {loc: why for loc in entries.locations if (why := cache.problem(loc)) is not None}


class DecodeCheckCache:
    """What the decode check found for each image, keyed by its location and the size and
    modification time of its file (``file_of``: the image file, or its shard or Parquet file),
    kept in ``folder/image_check_cache.json``, so a start does not decode every image again; a
    file that changes gets a new size or time and its images are checked again.

    It lives in the run's log folder, which is writable by definition (a dataset may sit on a
    read-only share) and goes away with the run's logs. Every rank writes the same content,
    through its own temporary file renamed into place, like the unreadable-files list. Without a
    folder it remembers nothing.
    """

    NAME = "image_check_cache.json"
    VERSION = 1  # bump when the check itself changes: old results are then ignored

    def __init__(self, folder: Path | None, file_of: Callable[[str], str] = str):
        self.folder, self.file_of = folder, file_of
        self.stats: dict[str, list[int]] = {}
        self.results: dict[str, list] = {}  # path -> [size, mtime_ns, problem or None]
        if folder is not None:
            try:
                saved = json.loads((folder / self.NAME).read_text())
                if saved.get("version") == self.VERSION:
                    self.results = dict(saved["files"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # no cache yet, or a damaged one: check every file again

    def _stat(self, location: str) -> list[int]:
        path = self.file_of(location)
        if path not in self.stats:
            try:
                st = os.stat(path)
                self.stats[path] = [st.st_size, st.st_mtime_ns]
            except OSError:
                self.stats[path] = [-1, -1]
        return self.stats[path]

    def unknown(self, paths: list[str]) -> list[str]:
        if self.folder is None:
            return list(paths)
        return [p for p in paths if p not in self.results or self.results[p][:2] != self._stat(p)]

    def remember(self, checked: list[str], problems: dict[str, str]) -> None:
        for path in checked:
            self.results[path] = [*self._stat(path), problems.get(path)]
        if self.folder is None:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"version": self.VERSION, "files": self.results}).encode()
            tmp = self.folder / f".{self.NAME}.{os.getpid()}.tmp"
            atomic_write(
                self.folder / self.NAME, lambda f: f.write(text), lambda: len(text), tmp=tmp
            )
        except (OSError, UserError) as err:  # only a cache: the next start checks again
            log.warning(f"could not write {self.folder / self.NAME} ({err})")

    def problem(self, path: str) -> str | None:
        if path in self.results:
            return self.results[path][2]
        return None


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

"""The table of every layout, and ``TableImages``, the dataset of its images.

(where each image is, its label) and the class names in compact arrays, read through the
table's ``RowKind``; ``TableImages`` gives (upright RGB image, label) whatever the layout. No
torch here (numpy only).
"""

from __future__ import annotations

import io
import logging
import mmap
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import IO, Any

import numpy as np
from PIL import Image

from imgtrainer.data.layouts.image_files import image_problem, open_rgb
from imgtrainer.errors import UserError, first_line
from imgtrainer.storage import LOCAL, Store, is_url, problem

log = logging.getLogger(__name__)


class Strings:
    """Many strings in two arrays: their utf-8 bytes end to end, and where each ends. Forked
    loader workers share the arrays' pages untouched; a list of str objects would be copied
    page by page as each worker touches the strings' reference counts (pytorch/pytorch#13246)."""

    def __init__(self, data: np.ndarray, ends: np.ndarray):
        self.data, self.ends = data, ends

    @classmethod
    def of(cls, strings: Sequence[str]) -> Strings:
        # Names from the file system or a tar header may hold bytes that are not UTF-8, kept
        # as Python keeps them (surrogate escapes) and written back as the same bytes.
        data = "".join(strings).encode(errors="surrogateescape")
        if len(data) == sum(map(len, strings)):  # ASCII: one byte a character
            lengths = np.fromiter(map(len, strings), dtype=np.int64, count=len(strings))
        else:
            lengths = np.fromiter(
                (len(s.encode(errors="surrogateescape")) for s in strings), np.int64, len(strings)
            )
        return cls(np.frombuffer(data, dtype=np.uint8).copy(), np.cumsum(lengths))

    @classmethod
    def joined(cls, parts: Sequence[Strings]) -> Strings:
        """The strings of ``parts``, one after another."""
        if not parts:
            return cls.of([])
        offsets = np.cumsum([0] + [len(part.data) for part in parts[:-1]])
        ends = [part.ends + offset for part, offset in zip(parts, offsets, strict=True)]
        return cls(np.concatenate([p.data for p in parts]), np.concatenate(ends).astype(np.int64))

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int) -> str:
        start = int(self.ends[i - 1]) if i > 0 else 0
        return self.data[start : int(self.ends[i])].tobytes().decode(errors="surrogateescape")

    def take(self, indices: np.ndarray) -> Strings:
        return Strings.of([self[int(i)] for i in indices])


class RowKind:
    """How a table's row names its image and how its bytes are read: one small object per
    storage kind (a file per image, a tar member, a Parquet row), kept in its layout's module
    and held by the tables of that kind. ``name`` goes into the table's fingerprint."""

    name = ""

    def location(self, table: ImageTable, i: int) -> str:
        """The image's name for people and reports, and the key of the decode check's results."""
        raise NotImplementedError

    def file_of(self, table: ImageTable, i: int) -> str:
        """The file whose size and modification time stand for the image's: its container."""
        return table.containers[int(table.container[i])]

    def read(self, table: ImageTable, i: int) -> bytes:
        """The encoded image's bytes."""
        raise NotImplementedError

    def image_file(self, table: ImageTable, i: int) -> str | IO[bytes]:
        """What the image decoder opens: the bytes as a file (a path, for a file of its own)."""
        return io.BytesIO(self.read(table, i))

    def groups(self, table: ImageTable) -> np.ndarray:
        """Each row's reading unit, for ``--sampler window``: here ``GROUP_ROWS`` rows in a row."""
        return np.arange(len(table)) // GROUP_ROWS

    def pieces(self, table: ImageTable, rows: np.ndarray) -> list[tuple[str, int, int]]:
        """What to fetch ahead for ``rows`` (of one group) as (object, offset, size), ranges of
        at least ``PIECE_BYTES`` where the layout has them; here each image's object whole."""
        return [(self.file_of(table, int(i)), 0, -1) for i in rows]


GROUP_ROWS = 256  # images of a folder or list that --sampler window takes as one unit
PIECE_BYTES = 16 << 20  # a shard is fetched ahead in ranges of about this size (whole if smaller)


@dataclass(frozen=True, eq=False)
class ImageTable:
    """Every image of one dataset as a row: ``containers[container[i]]`` (a folder, a tar
    shard, a Parquet file: few, kept as a list), ``members[i]`` (a file or member name; empty
    for Parquet), ``offsets[i]`` / ``sizes[i]`` (a tar member's data, a Parquet row number),
    ``labels[i]`` (an index into ``classes``). ``present`` are the classes the layout itself
    shows (a class folder, a label seen): one that ends up without images is an error."""

    kind: RowKind
    classes: list[str]
    containers: list[str]
    container: np.ndarray  # int32
    members: Strings
    offsets: np.ndarray  # int64
    sizes: np.ndarray  # int64
    labels: np.ndarray  # int64
    present: frozenset[int]
    source: str  # what the user named: the folder, list file, Parquet or shard pattern
    column: str = "image"  # Parquet: the column holding the image
    store: Store = LOCAL  # how the containers are reached: the disk, or an object store

    @classmethod
    def build(
        cls, kind: RowKind, source: str, classes: list[str], rows: dict[str, Any], **extra: Any
    ) -> ImageTable:
        """A table from per-row lists (``container``, ``labels``, and ``members``, ``offsets``,
        ``sizes`` as the kind needs), ``containers`` the container names."""
        n = len(rows["labels"])
        labels = np.asarray(rows["labels"], dtype=np.int64)
        members = rows.get("members", [""] * n)
        unused = np.broadcast_to(np.int64(0), (n,))  # a column this kind does not use: no memory
        return cls(
            kind=kind,
            classes=list(classes),
            containers=list(rows["containers"]),
            container=np.asarray(rows["container"], dtype=np.int32),
            members=members if isinstance(members, Strings) else Strings.of(members),
            offsets=np.asarray(rows.get("offsets", unused), dtype=np.int64),
            sizes=np.asarray(rows.get("sizes", unused), dtype=np.int64),
            labels=labels,
            present=frozenset(extra.pop("present", set(labels.tolist()))),
            source=source,
            **extra,
        )

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def remote(self) -> bool:
        """Whether its images are read from an object store (each read a request)."""
        return any(is_url(c) for c in self.containers[:1])

    def label(self, i: int) -> int:
        return int(self.labels[i])

    def location(self, i: int) -> str:
        """The image's name for people and reports: a path, ``shard.tar:member`` or
        ``file.parquet[row N]``; also the key of the decode check's results."""
        return self.kind.location(self, i)

    def file_of(self, i: int) -> str:
        """The file whose size and modification time stand for the image's (the decode check's
        cache): the image file itself, or its shard or Parquet file."""
        return self.kind.file_of(self, i)

    def read(self, i: int) -> bytes:
        """The encoded image's bytes."""
        return self.kind.read(self, i)

    @cached_property
    def reading_units(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's reading unit (its shard, Parquet row group or group of rows) numbered from
        0, the rows sorted by unit, and where each unit's rows start in them (a last end)."""
        unit = np.unique(self.kind.groups(self), return_inverse=True)[1].reshape(-1)
        by_unit = np.argsort(unit, kind="stable")
        count = int(unit.max()) + 1 if len(unit) else 0
        return unit, by_unit, np.searchsorted(unit[by_unit], np.arange(count + 1))

    @property
    def num_groups(self) -> int:
        """How many reading units the table's rows are in."""
        return len(self.reading_units[2]) - 1

    def groups(self) -> np.ndarray:
        """Each row's reading unit, numbered from 0: its shard, Parquet row group or group of
        rows."""
        return self.reading_units[0]

    def hold_group(self, group: int) -> list[str]:
        """Fetch the group's bytes into the store's cache ahead of their reads (``Store.hold``);
        the objects they are of, now held there (none when the store keeps no cache: each read
        is then a request). ``UserError`` for an object gone or cut short since the run listed
        it."""
        _, by_unit, starts = self.reading_units
        pieces = self.kind.pieces(self, by_unit[starts[group] : starts[group + 1]])
        held = True
        for url, offset, size in pieces:
            try:
                held = self.store.hold(url, offset, size) and held
            except Exception as err:
                raise UserError(
                    f"training data changed during the run: {problem(err, url)}; restore it, "
                    "or start the run again to index the data anew"
                ) from None
        return sorted({url for url, _, _ in pieces}) if held else []

    def fetch_groups(self, rows: Collection[int]) -> list[str]:
        """Fetch the whole groups that ``rows`` are in (``hold_group``); the objects held."""
        groups = np.unique(self.groups()[np.asarray(rows, dtype=np.int64)]).tolist()
        return sorted({url for group in groups for url in self.hold_group(group)})

    def open_rgb(self, i: int, draft: int | None = None) -> Image.Image:
        """The image as upright RGB (``image_files.open_rgb``)."""
        return open_rgb(self.kind.image_file(self, i), draft=draft)

    def problem(self, i: int) -> str | None:
        """None if the image decodes, else why not (one line): the decode check."""
        try:
            image = self.kind.image_file(self, i)
        except Exception as err:  # gone, or a damaged container: unreadable
            return first_line(err)
        return image_problem(image)

    def take(self, indices: np.ndarray) -> ImageTable:
        """The rows ``indices``, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        return replace(
            self,
            container=self.container[indices],
            members=self.members.take(indices),
            offsets=self.offsets[indices],
            sizes=self.sizes[indices],
            labels=self.labels[indices],
        )

    def without(self, locations: Collection[str]) -> ImageTable:
        """This table less the rows at ``locations`` (itself when none is here)."""
        if not locations:
            return self
        keep = np.array(
            [i for i in range(len(self)) if self.location(i) not in locations], dtype=np.int64
        )
        return self if len(keep) == len(self) else self.take(keep)

    def empty_classes(self, rows: np.ndarray | None = None) -> list[str]:
        """Classes the layout shows that hold no image (left out as unreadable, say), among
        ``rows`` when given (the readable ones)."""
        labels = self.labels if rows is None else self.labels[rows]
        counts = np.bincount(labels, minlength=len(self.classes))
        return [self.classes[c] for c in sorted(self.present) if counts[c] == 0]


UNKNOWN, READABLE, UNREADABLE = 0, 1, 2  # what is known of whether an image decodes


class ReadStates:
    """Whether each image of a table decodes, as far as is known: one byte an image in memory
    shared with the loader workers forked after it is made (an anonymous shared mapping). The
    decode check writes it as its results come in (``decode_check.DecodeCheck``); a worker
    that fails on an image marks it. Training never waits for it: ``read_or_next`` gives the
    same image for an index whatever it holds."""

    def __init__(self, n: int):
        self._map = mmap.mmap(-1, max(1, n))
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=n)

    def read_or_next(self, index: int, read: Callable[[int], Any], where: Callable[[int], str]):
        """``(i, read(i))`` for the first image from ``index`` on (wrapping round) that reads:
        one that does not decode gives the next one in its place. The image an index gives is
        a property of the files alone, the same in every run, rank and layout, whether the
        check has reached it or not (a known unreadable image is skipped without trying).
        Only an image the check found readable is worth a warning when it fails (changed,
        deleted, a disk error): the check reports the others once, in one line."""
        n = len(self.array)
        for offset in range(n):
            i = (index + offset) % n
            if self.array[i] == UNREADABLE:
                continue
            try:
                return i, read(i)
            except Exception as err:  # any decoder failure on a user's file
                if self.array[i] == READABLE:
                    log.warning(
                        f"could not read {where(i)} ({first_line(err)}); "
                        "using the next image in its place"
                    )
                self.array[i] = UNREADABLE
        raise RuntimeError(f"none of the {n} images can be read")


class TableImages:
    """The images of an ``ImageTable`` as a dataset of ``(upright RGB PIL image, label)``:
    what ImageFolder was to a folder, for every layout. An image that does not decode gives
    the next image in its place (``ReadStates.read_or_next``)."""

    def __init__(self, table: ImageTable):
        self.table = table
        self.states = ReadStates(len(table))

    @property
    def classes(self) -> list[str]:
        return self.table.classes

    @property
    def targets(self) -> np.ndarray:
        return self.table.labels

    def reference(self) -> TableImages:
        """Its images as the data audit makes them again: these, read and decoded by PIL."""
        return self

    def leave_out(self, locations: Collection[str]) -> None:
        """Drop the images at ``locations`` (found unreadable: the rest are readable)."""
        self.table = self.table.without(locations)
        self.states = ReadStates(len(self.table))
        self.states.array[:] = READABLE

    def empty_classes(self) -> list[str]:
        return self.table.empty_classes()

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        _, image = self.states.read_or_next(index, self.open_rgb, self.table.location)
        return image

    def open_rgb(self, i: int) -> tuple[Image.Image, int]:
        return self.table.open_rgb(i), self.table.label(i)

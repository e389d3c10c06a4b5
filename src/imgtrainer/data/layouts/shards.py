"""WebDataset tar shards as a table of ``TAR`` rows: an image is one ``pread`` at its offset.

Each shard's index of member offsets is built once and kept beside the shard (in ``index_dir``
when the shard folder is read-only), so an image is read in any order, in any worker. Members
follow WebDataset's names: ``key.jpg`` (or another image extension) and ``key.cls`` holding the
class index; the key is the member's name up to the first dot of its base name.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from functools import partial
from pathlib import Path

import numpy as np

from imgtrainer.data.layouts.image_files import IMAGE_EXTENSIONS
from imgtrainer.data.layouts.names import expand_pattern, labels_of, read_class_names
from imgtrainer.data.layouts.table import ImageTable, RowKind, Strings
from imgtrainer.errors import UserError
from imgtrainer.files import atomic_write
from imgtrainer.process import process_map

INDEX_SUFFIX = ".imgtrainer-index"
INDEX_VERSION = "imgtrainer-tar-index 1"
CLASSES_FILE = "classes.txt"


class TarRows(RowKind):
    """A row is the member ``members[i]`` of a tar shard, its data ``sizes[i]`` bytes at
    ``offsets[i]``: one ``pread``."""

    name = "tar"

    def location(self, table: ImageTable, i: int) -> str:
        return f"{table.containers[int(table.container[i])]}:{table.members[i]}"

    def read(self, table: ImageTable, i: int) -> bytes:
        path, size = table.containers[int(table.container[i])], int(table.sizes[i])
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, size, int(table.offsets[i]))
        finally:
            os.close(fd)
        if len(data) != size:
            raise OSError(f"{path} is shorter than its index says: rebuild the index")
        return data


TAR = TarRows()

IndexRow = tuple[int, int, int, str]  # (data offset, size, class index, image member name)


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's (key, extension) of a member name: ``a/b.x.jpg`` is (``a/b``, ``x.jpg``)."""
    folder, slash, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return folder + slash + stem, ext.lower()


Member = tuple[str, int, int]  # (name, data offset, size)


HEADER_WINDOW = 1 << 16  # bytes read at a time to find the headers: several small members
CHECKED_TOGETHER = 4096  # headers whose checksums are verified in one go


def ustar_members(fd: int) -> list[Member] | None:
    """The regular files of a plain ustar/GNU tar (what tarfile and webdataset's writers make),
    from their 512-byte headers alone, several times faster than ``tarfile``: each read takes
    the next window of the file, the checksums are verified a few thousand at a time. None for
    anything else (long names, pax headers, a damaged header): ``tarfile`` reads those."""
    members, blocks, offset = [], [], 0
    window, start = b"", 0
    while True:
        at = offset - start
        if at + 512 > len(window):
            start, window, at = offset, os.pread(fd, HEADER_WINDOW, offset), 0
        block = window[at : at + 512]
        if len(block) < 512 or block == ZERO_BLOCK:
            ended = len(block) == 512 or not block  # the end marker, or the file's end
            return members if ended and checksums_hold(blocks) else None
        kind = block[156]
        if block[124] & 0x80 or kind not in b"0\x00512":
            return None  # base-256 sizes, pax or GNU long-name headers
        size = int(block[124:136].strip(b"\0 ") or b"0", 8)
        blocks.append(block)
        if len(blocks) == CHECKED_TOGETHER:  # a shard of a million members: bounded memory
            if not checksums_hold(blocks):
                return None
            blocks = []
        if kind in b"0\x00":
            name = block[:100].split(b"\0", 1)[0]
            if block[257:262] == b"ustar" and block[345] != 0:
                name = block[345:500].split(b"\0", 1)[0] + b"/" + name
            members.append((name.decode(errors="surrogateescape"), offset + 512, size))
        offset += 512 + -(-size // 512) * 512


ZERO_BLOCK = bytes(512)


def checksums_hold(blocks: list[bytes]) -> bool:
    """Whether each header's stored checksum is the sum of its bytes, its checksum field
    counted as spaces."""
    if not blocks:
        return True
    heads = np.frombuffer(b"".join(blocks), np.uint8).reshape(-1, 512)
    sums = heads[:, :148].sum(1, dtype=np.int64) + heads[:, 156:].sum(1, dtype=np.int64) + 256
    stored = [block[148:156].strip(b"\0 ") for block in blocks]
    if not all(field.isdigit() for field in stored):
        return False
    return bool((np.array([int(field, 8) for field in stored], np.int64) == sums).all())


def tarfile_members(path: str) -> list[Member]:
    with tarfile.open(path, "r:") as tar:
        return [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]


def scan_shard(path: str) -> list[IndexRow]:
    """Read a shard's member headers (and its small ``.cls`` members): one row per sample."""
    images: dict[str, tuple[int, int, str]] = {}
    labels: dict[str, int] = {}
    order: list[str] = []
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            members = ustar_members(fd)
            members = tarfile_members(path) if members is None else members
            for name, offset, size in members:
                key, ext = split_key(name)
                if key not in images and key not in labels:
                    order.append(key)
                if ext == "cls":
                    text = os.pread(fd, size, offset).decode(errors="replace").strip()
                    if not text.lstrip("-").isdigit():
                        raise UserError(f"{path}:{name} holds {text!r}, not a class index")
                    labels[key] = int(text)
                elif f".{ext}" in IMAGE_EXTENSIONS and key not in images:
                    images[key] = (offset, size, name)
        finally:
            os.close(fd)
    except (OSError, tarfile.TarError) as err:
        raise UserError(f"tar shard {path}: cannot be read ({err})") from None
    rows = []
    for key in order:
        if key not in images or key not in labels:
            has = "no image member" if key not in images else "no .cls member"
            raise UserError(
                f"tar shard {path}: sample {key} has {has} (expected key.jpg + key.cls)"
            )
        offset, size, name = images[key]
        rows.append((offset, size, labels[key], name))
    return rows


def _stamp(path: str) -> str:
    st = os.stat(path)
    return f"{INDEX_VERSION} {st.st_size} {st.st_mtime_ns}"


def _index_places(path: str, index_dir: Path | None) -> list[Path]:
    places = [Path(path + INDEX_SUFFIX)]
    if index_dir is not None:
        digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
        places.append(index_dir / "tar-index" / f"{Path(path).name}.{digest}{INDEX_SUFFIX}")
    return places


def _read_index(place: Path, stamp: str) -> list[IndexRow] | None:
    try:
        lines = place.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if not lines or lines[0] != stamp:
        return None  # another shard by that name, or the shard changed: build it again
    rows = []
    for line in lines[1:]:
        offset, size, label, name = line.split("\t", 3)
        rows.append((int(offset), int(size), int(label), name))
    return rows


def shard_index(path: str, index_dir: Path | None) -> list[IndexRow]:
    """The shard's index: read where it was kept, else built and kept beside the shard (or in
    ``index_dir`` when that fails: a read-only share)."""
    stamp = _stamp(path)
    places = _index_places(path, index_dir)
    for place in places:
        rows = _read_index(place, stamp)
        if rows is not None:
            return rows
    rows = scan_shard(path)
    keep_index(path, rows, index_dir, stamp)
    return rows


def keep_index(
    path: str, rows: list[IndexRow], index_dir: Path | None = None, stamp: str | None = None
) -> None:
    """Keep ``rows``, the index of the (finished) shard at ``path``, beside it (or in
    ``index_dir`` when that fails: a read-only share)."""
    stamp = stamp or _stamp(path)
    text = (stamp + "\n" + "".join(f"{o}\t{s}\t{c}\t{n}\n" for o, s, c, n in rows)).encode()
    for place in _index_places(path, index_dir):
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(place, lambda f: f.write(text), lambda: len(text))
            break
        except (OSError, UserError):
            continue  # read-only: the next place, or build it again next time


def shard_table(
    spec: str,
    names: list[str] | None,
    fallback: list[str] | None,
    index_dir: Path | None,
    threads: int = 4,
) -> ImageTable:
    """The samples of every shard ``spec`` names, in shard order then member order; class
    names from ``names``, else ``classes.txt`` beside the first shard, else ``fallback``."""
    shards = expand_pattern(spec, ".tar")
    if not shards:
        raise UserError(f"tar shards {spec}: the pattern matches no file")
    beside = Path(shards[0]).parent / CLASSES_FILE
    if names is None and beside.is_file():
        names = read_class_names(beside)
    names = names or fallback
    if names is None:
        raise UserError(
            f"tar shards {spec}: no class names; put {CLASSES_FILE} beside the shards (one "
            "name a line, in index order) or pass --class_names FILE"
        )
    scan = partial(shard_arrays, index_dir=index_dir)
    if threads > 1 and len(shards) > 1:  # Python-bound (headers, index lines): processes
        parts = process_map(scan, shards, min(threads, len(shards)))
    else:
        parts = [scan(shard) for shard in shards]
    labels = np.concatenate([part[2] for part in parts])
    wrong = np.flatnonzero((labels < 0) | (labels >= len(names)))
    if len(wrong):
        labels_of([int(labels[wrong[0]])], names, f"tar shards {spec} (row {wrong[0]})")
    rows = {
        "containers": shards,
        "container": np.repeat(np.arange(len(shards), dtype=np.int32), [len(p[2]) for p in parts]),
        "offsets": np.concatenate([part[0] for part in parts]),
        "sizes": np.concatenate([part[1] for part in parts]),
        "members": Strings.joined([part[3] for part in parts]),
        "labels": labels,
    }
    return ImageTable.build(TAR, spec, names, rows)


def shard_arrays(
    shard: str, index_dir: Path | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Strings]:
    """A shard's index (``shard_index``) as compact arrays: (offsets, sizes, labels, member
    names): what a process scanning it hands back."""
    rows = shard_index(shard, index_dir)
    numbers = np.array([row[:3] for row in rows], dtype=np.int64).reshape(-1, 3)
    return numbers[:, 0], numbers[:, 1], numbers[:, 2], Strings.of([row[3] for row in rows])

"""WebDataset tar shards as a table of ``TAR`` rows: an image is one ranged read at its offset.

Each shard's index of member offsets is built once and kept beside the shard (in ``index_dir``
when the shard folder is read-only or in an object store), so an image is read in any order, in
any worker. Members follow WebDataset's names: ``key.jpg`` (or another image extension
webdataset decodes) and ``key.cls`` holding the class index, or ``key.json`` holding it in a
field; the key is the member's name up to the first dot of its base name.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from imgtrainer.data.layouts.image_files import IMAGE_EXTENSIONS
from imgtrainer.data.layouts.names import (
    PLAIN,
    Reading,
    expand_pattern,
    labels_of,
    read_class_names,
)
from imgtrainer.data.layouts.table import PIECE_BYTES, ImageTable, RowKind, Strings
from imgtrainer.errors import UserError
from imgtrainer.files import atomic_write
from imgtrainer.process import process_map
from imgtrainer.storage import LOCAL, Store, is_url, join, parent

INDEX_SUFFIX = ".imgtrainer-index"
REMOTE_INDICES = 32  # shard indices in an object store read at once (a request each)
INDEX_VERSION = "imgtrainer-tar-index 2"  # 2: member names JSON-quoted (any bytes)
CLASSES_FILE = "classes.txt"

# The image extensions webdataset's own decoders read (``webdataset.autodecode``: Pillow's
# formats) that Pillow decodes here without plugins; a test holds them to webdataset's list.
SHARD_IMAGE_EXTENSIONS = frozenset(
    {ext.lstrip(".") for ext in IMAGE_EXTENSIONS}
    | {"jpe", "jfif", "png", "apng", "gif", "pbm", "pnm", "dib", "tga", "ico", "sgi", "ras"}
)
LABEL_FIELD = "label"  # a .json member's field holding the class index, unless --label_column


class TarRows(RowKind):
    """A row is the member ``members[i]`` of a tar shard, its data ``sizes[i]`` bytes at
    ``offsets[i]``: one ``pread``."""

    name = "tar"

    def location(self, table: ImageTable, i: int) -> str:
        return f"{table.containers[int(table.container[i])]}:{table.members[i]}"

    def read(self, table: ImageTable, i: int) -> bytes:
        path = table.containers[int(table.container[i])]
        return table.store.read(path, int(table.offsets[i]), int(table.sizes[i]))

    def groups(self, table: ImageTable) -> np.ndarray:
        return table.container

    def pieces(self, table: ImageTable, rows: np.ndarray) -> list[tuple[str, int, int]]:
        """The shard's bytes that hold ``rows``, cut between members every ``PIECE_BYTES``."""
        rows = rows[np.argsort(table.offsets[rows])]
        starts, ends = table.offsets[rows], table.offsets[rows] + table.sizes[rows]
        cut = np.flatnonzero(np.diff(starts // PIECE_BYTES)) + 1  # a new piece at each boundary
        path = table.containers[int(table.container[rows[0]])]
        firsts, lasts = np.r_[0, cut], np.r_[cut - 1, len(rows) - 1]
        return [
            (path, int(starts[a]), int(ends[b] - starts[a]))
            for a, b in zip(firsts, lasts, strict=True)
        ]


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


def ustar_members(pread: Callable[[int, int], bytes]) -> list[Member] | None:
    """The regular files of a plain ustar/GNU tar (what tarfile and webdataset's writers make),
    from their 512-byte headers alone, several times faster than ``tarfile``: each read takes
    the next window of the file, the checksums are verified a few thousand at a time. None for
    anything else (long names, pax headers, a damaged header): ``tarfile`` reads those.
    ``pread(size, offset)`` reads the shard."""
    members, blocks, offset = [], [], 0
    window, start = b"", 0
    while True:
        at = offset - start
        if at + 512 > len(window):
            start, window, at = offset, pread(HEADER_WINDOW, offset), 0
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


def _pread_of(file) -> Callable[[int, int], bytes]:
    """``pread(size, offset)`` on an open file: a local one's descriptor, else seek and read
    (an object read from start to end in large requests)."""
    try:
        fd = file.fileno()
        return lambda size, offset: os.pread(fd, size, offset)
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
        pass

    def pread(size: int, offset: int) -> bytes:
        file.seek(offset)
        return file.read(size)

    return pread


def scan_shard(path: str, store: Store = LOCAL, label_field: str = "") -> list[IndexRow]:
    """Read a shard's member headers (and its small ``.cls`` or ``.json`` members): one row
    per sample."""
    images: dict[str, tuple[int, int, str]] = {}
    labels: dict[str, int] = {}
    order: list[str] = []
    try:
        with store.open(path) as file:
            pread = _pread_of(file)
            members = ustar_members(pread)
            if members is None:  # not plain ustar headers: the tarfile module reads them
                file.seek(0)
                with tarfile.open(fileobj=file, mode="r:") as tar:
                    members = [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]
            for name, offset, size in members:
                key, ext = split_key(name)
                if key not in images and key not in labels:
                    order.append(key)
                if ext == "cls" or (ext == "json" and key not in labels):
                    labels[key] = member_label(
                        pread(size, offset), ext, label_field, f"{path}:{name}"
                    )
                elif ext in SHARD_IMAGE_EXTENSIONS and key not in images:
                    images[key] = (offset, size, name)
    except (OSError, tarfile.TarError) as err:
        raise UserError(f"tar shard {path}: cannot be read ({err})") from None
    rows = []
    for key in order:
        if key not in images or key not in labels:
            has = "no image member" if key not in images else "no .cls or .json label member"
            raise UserError(
                f"tar shard {path}: sample {key} has {has} (expected key.jpg + key.cls)"
            )
        offset, size, name = images[key]
        rows.append((offset, size, labels[key], name))
    return rows


def member_label(data: bytes, ext: str, field: str, where: str) -> int:
    """The class index of a ``.cls`` member, or of a ``.json`` member's ``field``."""
    text = data.decode(errors="replace").strip()
    if ext == "json":
        field = field or LABEL_FIELD
        try:
            value = json.loads(text)[field]
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f"{where} has no {field!r} field; name the label's field with --label_column"
            ) from None
        text = str(value).strip()
    if not text.lstrip("-").isdigit():
        raise UserError(f"{where} holds {text!r}, not a class index")
    return int(text)


def _stamp(path: str, reading: Reading = PLAIN) -> str:
    """What an index records of its shard: a changed shard (size, time or version) or another
    --label_column needs a new one."""
    size, version = reading.store.version(path)
    field = f" label:{reading.label_column}" if reading.label_column else ""
    return f"{INDEX_VERSION} {size} {version}{field}"


def _index_places(path: str, index_dir: Path | None) -> list[str]:
    places = [path + INDEX_SUFFIX]
    if index_dir is not None:
        name = path if is_url(path) else os.path.abspath(path)
        digest = hashlib.sha1(name.encode()).hexdigest()[:16]
        leaf = path.rstrip("/").rsplit("/", 1)[-1]
        places.append(str(index_dir / "tar-index" / f"{leaf}.{digest}{INDEX_SUFFIX}"))
    return places


def _stamp_holds(line: str, stamp: str, uploaded: bool) -> bool:
    """Whether an index's first line is ``stamp``. Beside a shard in an object store (copied
    there with it, its time the disk's), the shard's size and the label field are enough."""
    if line == stamp:
        return True
    if not uploaded:
        return False
    mine, theirs = line.split(" "), stamp.split(" ")
    return mine[:3] == theirs[:3] and mine[4:] == theirs[4:]


def _read_index(place: str, stamp: str, store: Store) -> list[IndexRow] | None:
    """The index kept at ``place``; None when there is none, it is another shard's or an older
    one's, or it does not parse (hand-made, cut short): it is then built again."""
    uploaded = is_url(place)
    try:
        text = store.read(place) if uploaded else Path(place).read_bytes()
        lines = text.decode().splitlines()
    except Exception:  # none there (a missing object, an unreadable file): build it
        return None
    if not lines or not _stamp_holds(lines[0], stamp, uploaded):
        return None  # another shard by that name, or the shard changed: build it again
    try:
        return [_index_row(line) for line in lines[1:]]
    except (ValueError, TypeError):
        return None


def _index_row(line: str) -> IndexRow:
    offset, size, label, name = line.split("\t", 3)
    name = json.loads(name)
    if not isinstance(name, str) or min(int(offset), int(size)) < 0:
        raise ValueError(line)
    return int(offset), int(size), int(label), name


def shard_index(path: str, index_dir: Path | None, reading: Reading = PLAIN) -> list[IndexRow]:
    """The shard's index: read where it was kept, else built and kept beside the shard (or in
    ``index_dir`` when that fails: a read-only share, an object store)."""
    stamp = _stamp(path, reading)
    places = _index_places(path, index_dir)
    for place in places[::-1] if is_url(path) else places:  # this disk's copy first
        rows = _read_index(place, stamp, reading.store)
        if rows is not None:
            return rows
    rows = scan_shard(path, reading.store, reading.label_column)
    keep_index(path, rows, index_dir, stamp)
    return rows


def keep_index(
    path: str, rows: list[IndexRow], index_dir: Path | None = None, stamp: str | None = None
) -> None:
    """Keep ``rows``, the index of the (finished) shard at ``path``, beside it (or in
    ``index_dir`` when that fails: a read-only share, an object store: never written there)."""
    stamp = stamp or _stamp(path)
    # JSON-quoted names: a tab, a newline or bytes that are not UTF-8 (surrogate escapes) in a
    # member's name stay inside its field.
    lines = "".join(f"{o}\t{s}\t{c}\t{json.dumps(n)}\n" for o, s, c, n in rows)
    text = (stamp + "\n" + lines).encode()
    for place in _index_places(path, index_dir):
        if is_url(place):
            continue
        try:
            Path(place).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(Path(place), lambda f: f.write(text), lambda: len(text))
            break
        except (OSError, UserError):
            continue  # read-only: the next place, or build it again next time


def shard_class_names(spec: str, shards: list[str], store: Store) -> list[str] | None:
    """``classes.txt`` beside the first shard, if there is one."""
    beside = join(parent(shards[0]), CLASSES_FILE)
    if not is_url(beside):
        return read_class_names(beside) if Path(beside).is_file() else None
    try:
        text = store.read(beside).decode()
    except Exception:  # none there
        return None
    return read_class_names(beside, text)


def shard_table(
    spec: str, names: list[str] | None, fallback: list[str] | None, reading: Reading = PLAIN
) -> ImageTable:
    """The samples of every shard ``spec`` names, in shard order then member order; class
    names from ``names``, else ``classes.txt`` beside the first shard, else ``fallback``."""
    shards = expand_pattern(spec, ".tar", reading.store)
    if not shards:
        raise UserError(f"tar shards {spec}: the pattern matches no file")
    names = names or shard_class_names(spec, shards, reading.store) or fallback
    if names is None:
        raise UserError(
            f"tar shards {spec}: no class names; put {CLASSES_FILE} beside the shards (one "
            "name a line, in index order) or pass --class_names FILE"
        )
    scan = partial(shard_arrays, index_dir=reading.index_dir, reading=reading)
    if is_url(shards[0]):  # a round trip each: all of them at once
        with ThreadPoolExecutor(min(REMOTE_INDICES, len(shards))) as pool:
            parts = list(pool.map(scan, shards))
    elif reading.threads > 1 and len(shards) > 1:  # Python-bound (headers, lines): processes
        parts = process_map(scan, shards, min(reading.threads, len(shards)))
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
    return ImageTable.build(TAR, spec, names, rows, store=reading.store)


def shard_arrays(
    shard: str, index_dir: Path | None, reading: Reading = PLAIN
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Strings]:
    """A shard's index (``shard_index``) as compact arrays: (offsets, sizes, labels, member
    names): what a process scanning it hands back."""
    rows = shard_index(shard, index_dir, reading)
    numbers = np.array([row[:3] for row in rows], dtype=np.int64).reshape(-1, 3)
    return numbers[:, 0], numbers[:, 1], numbers[:, 2], Strings.of([row[3] for row in rows])

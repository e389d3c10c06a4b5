"""WebDataset tar shards as a map-style table: each shard's index of member offsets is built
once with ``tarfile`` and kept beside the shard (in ``index_dir`` when the shard folder is
read-only), so an image is one ``pread`` at its offset, in any order, in any worker.

Members follow WebDataset's names: ``key.jpg`` (or another image extension) and ``key.cls``
holding the class index; the key is the member's name up to the first dot of its base name.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from imgtrainer.data.image_files import IMAGE_EXTENSIONS
from imgtrainer.data.layouts import expand_pattern, labels_of, read_class_names
from imgtrainer.data.table import TAR, ImageTable
from imgtrainer.errors import UserError
from imgtrainer.files import atomic_write

INDEX_SUFFIX = ".imgtrainer-index"
INDEX_VERSION = "imgtrainer-tar-index 1"
CLASSES_FILE = "classes.txt"

IndexRow = tuple[int, int, int, str]  # (data offset, size, class index, image member name)


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's (key, extension) of a member name: ``a/b.x.jpg`` is (``a/b``, ``x.jpg``)."""
    folder, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return os.path.join(folder, stem) if folder else stem, ext.lower()


Member = tuple[str, int, int]  # (name, data offset, size)


def ustar_members(fd: int) -> list[Member] | None:
    """The regular files of a plain ustar/GNU tar (what tarfile and webdataset's writers make),
    from their 512-byte headers alone, several times faster than ``tarfile``. None for anything
    else (long names, pax headers, a damaged header): ``tarfile`` reads those."""
    members, offset = [], 0
    while True:
        block = os.pread(fd, 512, offset)
        if len(block) < 512 or block == bytes(512):
            return members if block == bytes(512) or not block else None
        stored = block[148:156].strip(b"\0 ")
        checksum = sum(block[:148]) + 8 * 32 + sum(block[156:])
        if not stored.isdigit() or int(stored, 8) != checksum or block[124] & 0x80:
            return None
        kind, size = block[156:157], int(block[124:136].strip(b"\0 ") or b"0", 8)
        if kind not in (b"0", b"\0", b"5", b"1", b"2"):
            return None  # pax or GNU long-name headers
        name = block[:100].split(b"\0", 1)[0]
        if block[257:262] == b"ustar" and block[345] != 0:
            name = block[345:500].split(b"\0", 1)[0] + b"/" + name
        if kind in (b"0", b"\0"):
            members.append((name.decode(errors="surrogateescape"), offset + 512, size))
        offset += 512 + -(-size // 512) * 512


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
    text = (stamp + "\n" + "".join(f"{o}\t{s}\t{c}\t{n}\n" for o, s, c, n in rows)).encode()
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            tmp = place.parent / f".{place.name}.{os.getpid()}.tmp"
            atomic_write(place, lambda f: f.write(text), lambda: len(text), tmp=tmp)
            break
        except (OSError, UserError):
            continue  # read-only: the next place, or build it again next time
    return rows


def shard_table(
    spec: str,
    names: list[str] | None,
    fallback: list[str] | None,
    index_dir: Path | None,
    threads: int = 4,
) -> ImageTable:
    """The samples of every shard ``spec`` names, in shard order then member order; class
    names from ``names``, else ``classes.txt`` beside the first shard, else ``fallback``."""
    shards = expand_pattern(spec)
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
    with ThreadPoolExecutor(max(1, threads)) as pool:
        indices = list(pool.map(lambda shard: shard_index(shard, index_dir), shards))
    rows: dict[str, list] = {
        "containers": shards,
        "container": [],
        "members": [],
        "offsets": [],
        "sizes": [],
    }
    labels = []
    for n, index in enumerate(indices):
        for offset, size, label, name in index:
            rows["container"].append(n)
            rows["offsets"].append(offset)
            rows["sizes"].append(size)
            rows["members"].append(name)
            labels.append(label)
    names, rows["labels"] = labels_of(labels, names, f"tar shards {spec}")
    return ImageTable.build(TAR, spec, names, rows)

"""A bounded local cache of byte ranges of remote objects, shared by the processes of a node.

Each object's ranges live in one sparse file at their own offsets, with a log of the ranges it
holds (offset, size, crc32), appended after the bytes: a process reads only ranges it sees
logged and whose checksum holds. Past the bound, the objects written longest ago go whole.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

TRIM_SHARE = 0.05  # a process looks at the folder's size after adding this share of the bound
KEEP_SHARE = 0.9  # and trims it to this share


@dataclass
class _Object:
    data: int  # descriptors of the sparse file and its log
    log: int
    inode: int
    ranges: dict[tuple[int, int], int] = field(default_factory=dict)  # -> crc32
    seen: int = 0  # bytes of the log read so far
    whole: int = -1  # the size of the object when all of it is held (a range (0, -1))


class RangeCache:
    """Byte ranges of objects (by ``key``: the URL and its version) in ``folder``, at most
    about ``limit`` bytes in all. Any number of processes may share the folder."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = Path(folder), limit
        self.objects: dict[str, _Object] = {}
        self.pid = os.getpid()
        self.added = 0

    def _name(self, key: str) -> Path:
        return self.folder / hashlib.sha1(key.encode()).hexdigest()

    def _object(self, key: str, create: bool) -> _Object | None:
        if self.pid != os.getpid():  # a forked process: descriptors of its own
            self.objects, self.pid, self.added = {}, os.getpid(), 0
        found = self.objects.get(key)
        if found is not None:
            return found
        base = self._name(key)
        try:
            if create:
                self.folder.mkdir(parents=True, exist_ok=True)
            flags = (os.O_CREAT if create else 0) | os.O_NOFOLLOW  # never a planted link's target
            data = os.open(f"{base}.data", os.O_RDWR | flags, 0o644)
        except OSError:
            return None
        try:
            log = os.open(
                f"{base}.log", os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644
            )
        except OSError:
            os.close(data)  # not left open when its log cannot be
            return None
        self.objects[key] = found = _Object(data, log, os.fstat(data).st_ino)
        return found

    def _refresh(self, obj: _Object) -> None:
        """The ranges other processes logged since this one last looked."""
        text = os.pread(obj.log, 1 << 24, obj.seen)
        complete = text[: text.rfind(b"\n") + 1]  # a line being written is read next time
        obj.seen += len(complete)
        for line in complete.splitlines():
            parts = line.split()
            if not all(part.lstrip(b"-").isdigit() for part in parts):
                continue  # a damaged line: its range is read from the store again
            if len(parts) == 3:
                obj.ranges[int(parts[0]), int(parts[1])] = int(parts[2])
            elif len(parts) == 4:  # a whole object: its size too
                obj.ranges[0, -1] = int(parts[2])
                obj.whole = int(parts[3])

    def get(self, key: str, offset: int, size: int) -> bytes | None:
        """The bytes at ``offset`` (``size`` -1: the whole object) if held, else None."""
        obj = self._object(key, create=False)
        if obj is None:
            return None
        if (offset, size) not in obj.ranges:
            self._refresh(obj)
        crc = obj.ranges.get((offset, size))
        if crc is None:
            return None
        length = obj.whole if size < 0 else size
        data = os.pread(obj.data, length, offset)
        if len(data) != length or zlib.crc32(data) != crc:  # trimmed meanwhile, or torn
            del obj.ranges[offset, size]
            return None
        return data

    def put(self, key: str, offset: int, data: bytes, whole: bool = False) -> None:
        """Keep ``data``, the bytes at ``offset`` (``whole``: all of the object)."""
        if self.limit <= 0:
            return
        obj = self._object(key, create=True)
        if obj is None:
            return  # no room for a cache folder: reads go to the store
        crc = zlib.crc32(data)
        try:
            os.pwrite(obj.data, data, offset)
            line = f"0 -1 {crc} {len(data)}" if whole else f"{offset} {len(data)} {crc}"
            os.write(obj.log, f"{line}\n".encode())
        except OSError:
            return  # a full disk: the cache is only a cache
        if whole:
            obj.ranges[0, -1], obj.whole = crc, len(data)
        else:
            obj.ranges[offset, len(data)] = crc
        self.added += len(data)
        if self.added > self.limit * TRIM_SHARE:
            self.added = 0
            self.trim()

    def trim(self) -> None:
        """Delete the objects written longest ago until the folder is within the bound;
        forget the objects another process deleted."""
        try:
            entries = [(e, e.stat()) for e in os.scandir(self.folder) if e.name.endswith(".data")]
        except OSError:
            return
        total = sum(st.st_blocks * 512 for _, st in entries)
        for entry, _ in sorted(entries, key=lambda pair: pair[1].st_mtime_ns):
            if total <= self.limit * KEEP_SHARE:
                break
            total -= entry.stat().st_blocks * 512
            base = entry.path.removesuffix(".data")
            for suffix in (".data", ".log"):
                Path(base + suffix).unlink(missing_ok=True)
        for key, obj in list(self.objects.items()):
            try:
                same = os.stat(f"{self._name(key)}.data").st_ino == obj.inode
            except OSError:
                same = False
            if not same:
                os.close(obj.data)
                os.close(obj.log)
                del self.objects[key]

    def size(self) -> int:
        """Bytes the cache holds on disk now."""
        try:
            return sum(
                e.stat().st_blocks * 512
                for e in os.scandir(self.folder)
                if e.name.endswith(".data")
            )
        except OSError:
            return 0

"""A bounded local cache of byte ranges of remote objects, shared by the processes of a node.

Each object's ranges live in one sparse file at their own offsets, with a log of the ranges it
holds (offset, size, crc32), appended after the bytes: a process reads only ranges it sees
logged and whose checksum holds; a large range (a shard fetched ahead) serves the reads inside
it. Past the bound, the objects retired (no longer needed) go first, then those written longest
ago. A claim file tells the node's other processes that a range is being fetched.
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

TRIM_SHARE = 0.05  # a process looks at the folder's size after adding this share of the bound
KEEP_SHARE = 0.9  # and trims it to this share
CLAIM_SECONDS = 300  # a claim older than this is taken over, as one of a process that is gone


@dataclass
class _Object:
    data: int  # descriptors of the sparse file and its log
    log: int
    inode: int
    ranges: dict[tuple[int, int], int] = field(default_factory=dict)  # -> crc32
    seen: int = 0  # bytes of the log read so far
    whole: int = -1  # the size of the object when all of it is held (a range (0, -1))
    spans: set[tuple[int, int]] = field(default_factory=set)  # the large ranges, whole as (0, -1)
    checked: set[tuple[int, int]] = field(default_factory=set)  # spans whose checksum held here


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
            numbers = [part.lstrip(b"-").isdigit() for part in parts]
            if len(parts) not in (3, 4) or not all(numbers[:3]):
                continue  # a damaged line: its range is read from the store again
            if len(parts) == 4 and parts[1] == b"-1" and numbers[3]:  # a whole object: its size
                obj.whole = int(parts[3])
                self._add(obj, (0, -1), int(parts[2]), span=True)
            elif len(parts) == 3 or parts[3] == b"+":  # "+": a span, fetched ahead of its reads
                self._add(obj, (int(parts[0]), int(parts[1])), int(parts[2]), len(parts) == 4)

    @staticmethod
    def _add(obj: _Object, held: tuple[int, int], crc: int, span: bool) -> None:
        obj.ranges[held] = crc
        if span:
            obj.spans.add(held)

    def _span(self, obj: _Object, offset: int, size: int) -> tuple[int, int] | None:
        """A held large range around ``size`` bytes at ``offset``, its checksum verified once."""
        for start, length in obj.spans:
            end = start + (obj.whole if length < 0 else length)
            if start <= offset and offset + size <= end and size >= 0:
                if (start, length) in obj.checked or self._holds(obj, start, end - start):
                    obj.checked.add((start, length))
                    return start, length
                obj.spans.discard((start, length))
                obj.ranges.pop((start, length), None)
        return None

    @staticmethod
    def _holds(obj: _Object, start: int, size: int) -> bool:
        """Whether the file's bytes there have the logged range's checksum (read in parts)."""
        crc, at = 0, start
        while at < start + size:
            part = os.pread(obj.data, min(8 << 20, start + size - at), at)
            if not part:
                return False
            crc, at = zlib.crc32(part, crc), at + len(part)
        return crc == obj.ranges.get((start, size), obj.ranges.get((0, -1)))

    def get(self, key: str, offset: int, size: int) -> bytes | None:
        """The bytes at ``offset`` (``size`` -1: the whole object) if held, alone or inside a
        larger range, else None."""
        obj = self._object(key, create=False)
        if obj is None:
            return None
        if (offset, size) not in obj.ranges:
            self._refresh(obj)
        crc = obj.ranges.get((offset, size))
        if crc is None:
            span = self._span(obj, offset, size)
            return None if span is None else os.pread(obj.data, size, offset)
        length = obj.whole if size < 0 else size
        data = os.pread(obj.data, length, offset)
        if len(data) != length or zlib.crc32(data) != crc:  # trimmed meanwhile, or torn
            del obj.ranges[offset, size]
            return None
        return data

    def holds(self, key: str, offset: int, size: int) -> bool:
        """Whether the range is held (alone or inside a larger one), without reading it."""
        obj = self._object(key, create=False)
        if obj is None:
            return False
        self._refresh(obj)
        return (offset, size) in obj.ranges or self._span(obj, offset, max(0, size)) is not None

    def claim(self, key: str, offset: int) -> bool:
        """Whether this process may fetch ``key``'s range at ``offset`` now: True unless a live
        process of the node claimed it less than ``CLAIM_SECONDS`` ago (its pid in the file)."""
        claim = Path(f"{self._name(key)}.{offset}.claim")
        mine = claim.with_name(f"{claim.name}.{os.getpid()}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            mine.write_text(str(os.getpid()))
            for _ in range(2):
                try:
                    os.link(mine, claim)  # atomic, with its content
                    return True
                except FileExistsError:
                    if not _stale(claim):
                        return False
                    claim.unlink(missing_ok=True)
            return False
        except OSError:
            return True  # no claims here (a full disk): fetch it
        finally:
            mine.unlink(missing_ok=True)

    def release(self, key: str, offset: int) -> None:
        Path(f"{self._name(key)}.{offset}.claim").unlink(missing_ok=True)

    def retire(self, key: str) -> None:
        """The object is no longer needed: the first to go when the cache is trimmed."""
        try:
            os.utime(f"{self._name(key)}.data", ns=(0, 0))
        except OSError:
            pass

    def put(self, key: str, offset: int, data: bytes, whole: bool = False, span: bool = False):
        """Keep ``data``, the bytes at ``offset`` (``whole``: all of the object; ``span``: it
        serves the reads inside it too)."""
        if self.limit <= 0:
            return
        obj = self._object(key, create=True)
        if obj is None:
            return  # no room for a cache folder: reads go to the store
        crc = zlib.crc32(data)
        try:
            if os.pwrite(obj.data, data, offset) != len(data):
                return  # a full disk: the cache is only a cache
            line = f"0 -1 {crc} {len(data)}" if whole else f"{offset} {len(data)} {crc}"
            os.write(obj.log, f"{line}{' +' * (span and not whole)}\n".encode())
        except OSError:
            return
        if whole:
            obj.whole = len(data)
        held = (0, -1) if whole else (offset, len(data))
        self._add(obj, held, crc, span or whole)
        obj.checked.add(held)
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


def _stale(claim: Path) -> bool:
    """Whether a claim file's process is gone, or the claim is older than ``CLAIM_SECONDS``."""
    try:
        pid, age = int(claim.read_text()), time.time() - claim.stat().st_mtime
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):  # another user's live process, or gone meanwhile
        return False
    return age > CLAIM_SECONDS

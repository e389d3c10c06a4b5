"""Bytes by path or URL: the one place that opens data, checkpoints and records, on the disk
or in an object store (``s3://``, ``gs://``, ``az://`` through fsspec).

Remote reads are ranged, retried with backoff and kept in a bounded local cache (``cache``);
``Store`` travels with the tables into forked loader workers. No torch here.
"""

from __future__ import annotations

import io
import os
import posixpath
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from imgtrainer.errors import UserError
from imgtrainer.storage.cache import RangeCache
from imgtrainer.storage.remote import (
    INSTALL,
    as_user_error,
    filesystem,
    is_url,
    parse_options,
    problem,
    retried,
)

__all__ = ["INSTALL", "LOCAL", "Store", "is_url", "join", "parent", "parse_options", "problem"]

# What a listing said of each object this process has seen: URL -> (size, version tag). Forked
# workers inherit it, so a read needs no request of its own to know an object's version.
_SEEN: dict[str, tuple[int, str]] = {}
_CACHES: dict[tuple[int, str], RangeCache] = {}

# This run's mark for objects no listing saw: set where the package is imported first (the
# launcher's torchrun agent, whose forked ranks and their workers share it).
UNLISTED = f"unlisted-{os.getpid()}-{time.time_ns()}"
STREAM_BLOCK = 8 << 20  # bytes per request when an object is read from start to end
CLAIM_POLL = 0.02  # seconds between looks at a range another process is fetching


def join(folder: str, name: str) -> str:
    """``name`` relative to ``folder`` (a path or a URL); an absolute path or a URL as is."""
    if is_url(name) or os.path.isabs(name):
        return name
    if not is_url(folder):
        return os.path.join(folder, name)
    scheme, _, path = folder.partition("://")
    return f"{scheme}://{posixpath.normpath(posixpath.join(path, name))}"  # ../ resolved


# Where a dataset's rows may point: files, and objects of these stores (fsspec's names).
ROW_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def row_may_name(base: str, location: str) -> bool:
    """Whether a row of the dataset at ``base`` may name ``location``: a file, or an object of
    an object store, but never another bucket of a dataset in a bucket (``../other-bucket``),
    nor an http:// or other address (a request to wherever a hostile dataset points)."""
    if not is_url(location):
        return True
    theirs = urlsplit(location)
    if theirs.scheme not in ROW_SCHEMES:
        return False
    mine = urlsplit(base)
    return not is_url(base) or (mine.scheme, mine.netloc) == (theirs.scheme, theirs.netloc)


def parent(path: str) -> str:
    """The folder of a path or URL."""
    return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(path)


def _url(fs: Any, path: str, like: str) -> str:
    """fsspec's protocol-less path as a URL of ``like``'s protocol."""
    protocol = like.partition("://")[0]
    return path if is_url(path) else f"{protocol}://{path.lstrip('/')}"


def _tag(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "LastModified", "mtime", "last_modified"):
        if info.get(key):
            return str(info[key]).strip('"')
    return ""


def _remember(url: str, info: dict[str, Any]) -> None:
    _SEEN[url] = (int(info.get("size") or 0), _tag(info))


def _files(fs: Any, found: dict[str, dict[str, Any]], like: str) -> list[str]:
    """The files of a detailed listing (folders left out) as sorted URLs of ``like``'s
    protocol, each remembered with its version."""
    urls = []
    for name, info in found.items():
        if info.get("type", "file") != "directory":
            urls.append(_url(fs, name, like))
            _remember(urls[-1], info)
    return sorted(urls)


@dataclass(frozen=True)
class Store:
    """How this run reaches its files: ``options`` (--storage_options, JSON) for object
    stores, and the local byte cache of remote reads (``cache_dir``, ``cache_bytes``: none
    when 0). Local paths are read as they always were."""

    options: str = ""
    cache_dir: str = ""
    cache_bytes: int = 0

    # -- reading ----------------------------------------------------------------------------
    def read(self, path: str, offset: int = 0, size: int = -1) -> bytes:
        """``size`` bytes at ``offset`` (-1: the whole object): one ``pread`` for a local
        file, one ranged request for an object (retried; from the cache when held there)."""
        if not is_url(path):
            return _read_local(path, offset, size)
        cache, key = self._cache(), self.cache_key(path)
        data = cache.get(key, offset, size) if cache else None
        if data is None:
            data = retried(lambda: self._fetch(path, offset, size))
            if cache:
                cache.put(key, offset, data, whole=size < 0)
        return data

    def hold(self, url: str, offset: int, size: int) -> bool:
        """Fetch the range into the cache ahead of its reads (retried), unless it is held or
        another process of the node is fetching it (then wait for that); False when there is
        no cache to hold it."""
        cache, key = self._cache(), self.cache_key(url)
        while cache and not cache.holds(key, offset, size):
            if not cache.claim(key, offset):
                time.sleep(CLAIM_POLL)
                continue
            try:
                data = retried(lambda: self._fetch(url, offset, size))
                cache.put(key, offset, data, whole=size < 0, span=True)
            finally:
                cache.release(key, offset)
            return True
        return cache is not None

    def retire(self, url: str) -> None:
        """The object is no longer needed this epoch: the first the cache drops."""
        if cache := self._cache():
            cache.retire(self.cache_key(url))

    def _fetch(self, url: str, offset: int, size: int) -> bytes:
        fs = filesystem(url, self.options)
        if size < 0:  # from byte 0 on: one request (s3fs asks for the size first without it)
            return b"" if _SEEN.get(url, (-1,))[0] == 0 else fs.cat_file(url, start=0)
        data = fs.cat_file(url, start=offset, end=offset + size)
        if len(data) != size:
            raise OSError(f"{url} is shorter than its index says ({len(data)} of {size} bytes)")
        return data

    def _cache(self) -> RangeCache | None:
        if not self.cache_dir or self.cache_bytes <= 0:
            return None
        key = (os.getpid(), self.cache_dir)
        if key not in _CACHES:
            _CACHES[key] = RangeCache(Path(self.cache_dir), self.cache_bytes)
        return _CACHES[key]

    def cache_key(self, url: str) -> str:
        """The object and its version as a listing saw it: a changed object is a new key. An
        object no listing saw (a list's image URL) has no version to key it by: its bytes are
        kept for this run only (``UNLISTED``), never served to a later one stale."""
        size, tag = _SEEN.get(url, (-1, UNLISTED))
        return f"{url}\0{size}\0{tag}"

    def open(self, path: str) -> IO[bytes]:
        """The file or object for reading from start to end (a scan): large requests."""
        if not is_url(path):
            return open(path, "rb")
        fs = filesystem(path, self.options)
        return as_user_error(
            lambda: fs.open(path, "rb", block_size=STREAM_BLOCK, cache_type="readahead"), path
        )

    def ranged(self, path: str) -> IO[bytes]:
        """The file or object as a seekable file whose reads are ``read``'s (for pyarrow:
        each of its reads is one ranged, cached request)."""
        if not is_url(path):
            return open(path, "rb")
        return RangedFile(self, path, self.size(path))

    def read_text(self, path: str) -> str:
        if not is_url(path):
            return Path(path).read_text()
        return as_user_error(lambda: self._fetch(path, 0, -1), path).decode()

    def connect(self, url: str) -> None:
        """This process's client of ``url``'s store, made and probed now (``UserError``)."""
        filesystem(url, self.options)

    # -- what there is ----------------------------------------------------------------------
    def info(self, url: str) -> dict[str, Any]:
        """An object's size and version (one request, remembered); ``UserError`` if missing."""
        fs = filesystem(url, self.options)
        info = as_user_error(lambda: fs.info(url), url)
        _remember(url, info)
        return info

    def size(self, path: str) -> int:
        if not is_url(path):
            return os.path.getsize(path)
        if path not in _SEEN:
            self.info(path)
        return _SEEN[path][0]

    def version(self, path: str) -> tuple[int, str]:
        """(size, what changes with the content): a file's modification time in ns, an
        object's version tag (its ETag) as listed."""
        if not is_url(path):
            st = os.stat(path)
            return st.st_size, str(st.st_mtime_ns)
        if path not in _SEEN:
            self.info(path)
        return _SEEN[path]

    def stat(self, path: str) -> tuple[int, int]:
        """(size, a number that changes with the file): the modification time of a local
        file, the version tag's hash for an object; (-1, -1) when not known."""
        if not is_url(path):
            st = os.stat(path)
            return st.st_size, st.st_mtime_ns
        if path not in _SEEN:
            return -1, -1
        size, tag = _SEEN[path]
        return size, int.from_bytes(tag.encode()[-8:].rjust(8, b"\0"), "big") >> 1

    def exists(self, path: str) -> bool:
        if not is_url(path):
            return os.path.exists(path)
        fs = filesystem(path, self.options)
        return bool(as_user_error(lambda: fs.exists(path), path))

    def is_file(self, path: str) -> bool:
        if not is_url(path):
            return os.path.isfile(path)
        fs = filesystem(path, self.options)
        return bool(as_user_error(lambda: fs.isfile(path), path))

    def listing(self, url: str, recursive: bool = False, missing_ok: bool = False) -> list[str]:
        """The objects under ``url`` (a folder), sorted, each remembered with its version;
        ``UserError`` for a bucket that does not exist, or (unless ``missing_ok``: a folder
        nothing was written to yet) a folder that holds nothing."""
        fs = filesystem(url, self.options)

        def objects() -> dict[str, dict[str, Any]]:
            try:
                if recursive:
                    return fs.find(url, detail=True)
                return {i["name"]: i for i in fs.ls(url, detail=True)}
            except FileNotFoundError:
                if missing_ok:
                    return {}
                raise

        return _files(fs, as_user_error(objects, url), url)

    def glob(self, pattern: str) -> list[str]:
        fs = filesystem(pattern, self.options)
        return _files(fs, as_user_error(lambda: fs.glob(pattern, detail=True), pattern), pattern)

    def files_named(self, urls: list[str]) -> list[str]:
        """``urls`` if each exists (one listing per folder), else ``UserError`` naming one."""
        folders: dict[str, set[str]] = {}
        for url in urls:
            folder = parent(url)
            if folder not in folders:
                folders[folder] = set(self.listing(folder))
            if url not in folders[folder]:
                raise UserError(f"{url} does not exist")
        return urls

    # -- writing (checkpoints, records) -----------------------------------------------------
    def put_file(self, local: Path, url: str) -> None:
        """Upload a local file: the store's put is atomic (the object appears whole, or the
        old one stays)."""
        fs = filesystem(url, self.options)
        retried(lambda: fs.put_file(str(local), url))

    def put_bytes(self, url: str, data: bytes) -> None:
        fs = filesystem(url, self.options)
        retried(lambda: fs.pipe_file(url, data))

    def get_file(self, url: str, local: Path) -> None:
        fs = filesystem(url, self.options)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.download")
        try:
            retried(lambda: fs.get_file(url, str(tmp)))
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def copy(self, source: str, url: str) -> None:
        """A copy inside the store (no bytes through this machine), object to object: no
        listing of either as a folder first (fsspec's ``copy`` lists both)."""
        fs = filesystem(url, self.options)
        retried(lambda: fs.cp_file(source, url))

    def remove(self, url: str) -> None:
        fs = filesystem(url, self.options)
        try:
            retried(lambda: fs.rm_file(url))
        except FileNotFoundError:
            pass

    def check_writable(self, url: str) -> None:
        """One line now if ``url``'s bucket cannot be reached or written (credentials, a
        missing bucket, an endpoint that does not answer)."""
        fs = filesystem(url, self.options)
        probe = f"{url.rstrip('/')}/.imgtrainer-write-check"
        as_user_error(lambda: fs.pipe_file(probe, b"ok"), url)
        as_user_error(lambda: fs.rm_file(probe), url)


LOCAL = Store()


def _read_local(path: str, offset: int, size: int) -> bytes:
    if size < 0:
        with open(path, "rb") as f:
            return f.read()
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    if len(data) != size:
        raise OSError(f"{path} is shorter than its index says: rebuild the index")
    return data


class RangedFile(io.RawIOBase):
    """An object as a seekable, read-only file; each read is one ``Store.read``."""

    def __init__(self, store: Store, url: str, size: int):
        super().__init__()
        self.store, self.url, self.length, self.pos = store, url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = self.length if size is None or size < 0 else min(self.length, self.pos + size)
        if end <= self.pos:
            return b""
        data = self.store.read(self.url, self.pos, end - self.pos)
        self.pos = end
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)

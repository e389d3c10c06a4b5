"""Writing files so that a crash never leaves a half-written one: write, fsync, rename."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO

from imgtrainer.errors import UserError

# errno values that mean "no room to write": a full disk, or a full quota.
NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


# A file made here, never one (or a link) that was there: a shared folder's planted link is
# never followed.
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def new_file(path: Path) -> IO[bytes]:
    """``path`` made anew for writing (``NEW_FILE``)."""
    return os.fdopen(os.open(path, NEW_FILE, 0o644), "wb")


def atomic_write(
    path: Path,
    write: Callable[[IO[bytes]], None],
    needed_bytes: Callable[[], int],
    keep_previous_as: Path | None = None,
    tmp: Path | None = None,
) -> None:
    """``write(file)`` to a temporary file beside ``path``, fsync, then rename it into place.

    A crash leaves the old file or the new one, never a torn one. With ``keep_previous_as`` the
    file being replaced is kept under that name. ``tmp``: the temporary file (default
    ``.<name>.<pid>.tmp``: several processes may write the same file, the last rename wins
    whole). When the disk (or quota) is full, the partial temporary file is removed, the existing files are left as they were, and the error is one
    line naming the file, the space it needs (``needed_bytes()``) and the space free.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a link planted there goes: never written through
    try:
        with new_file(tmp) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:  # the partial file goes, whatever stopped the write
        tmp.unlink(missing_ok=True)
        needed = _needed_if_out_of_space(err, path.parent, needed_bytes)
        if needed is not None:
            raise disk_full_error(path, needed) from None
        raise
    if keep_previous_as is not None and path.exists():
        os.replace(path, keep_previous_as)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# Slack on top of the estimated size of a file (zip records, pickled structure).
SIZE_SLACK_BYTES = 1 << 20


def _needed_if_out_of_space(
    err: BaseException, folder: Path, needed_bytes: Callable[[], int]
) -> int | None:
    """The bytes the file needs if ``err`` means the disk (or quota) was full, else None.

    ``torch.save`` reports a full disk from inside its zip writer as a RuntimeError ("[enforce
    fail at inline_container.cc:...] . unexpected pos ..."), not an OSError; the file's own
    ENOSPC/EDQUOT is then its ``__context__``, found even where the folder shows free space (a
    quota). Without one, the folder's free space (the partial file removed) decides.
    """
    if not isinstance(err, OSError | RuntimeError):
        return None
    if any(isinstance(e, OSError) and e.errno in NO_SPACE for e in _error_chain(err)):
        return needed_bytes()
    needed = needed_bytes()
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    return needed if free < needed + SIZE_SLACK_BYTES else None


def _error_chain(err: BaseException) -> list[BaseException]:
    """``err`` and the errors it was raised from or while handling."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def atomic_link(source: Path, path: Path) -> bool:
    """Make ``path`` a second name (a hard link) of ``source``'s file, replacing ``path``
    atomically; False where the file system has no hard links. Only for files that are never
    modified in place, only replaced (``atomic_write``): replacing one name then leaves the
    other on the old content."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    _fsync_dir(path.parent)
    return True


def _fsync_dir(folder: Path) -> None:
    """Make the renames themselves durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_full_error(path: Path, needed: int) -> UserError:
    free = shutil.disk_usage(path.parent).free
    # A full quota (or inode table) leaves free space in view: say why the write still failed.
    enough = free >= needed + SIZE_SLACK_BYTES
    quota = " but a disk quota (or the file system's inode limit) is reached" if enough else ""
    return UserError(
        f"no space left on the device to write {path}: it needs about "
        f"{format_bytes(needed)}, {format_bytes(free)} are free there{quota}; free some "
        "space, then continue with --resume auto (the files written before are "
        "intact)"
    )


BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def format_bytes(n: float, unit: str | None = None, digits: int | None = None) -> str:
    """``n`` bytes for a message: in the largest unit up to GiB that keeps the number under 1024
    ("12.0 MiB"), or in ``unit``; one decimal (none for bytes) unless ``digits`` says otherwise
    (``format_bytes(n, "GiB", 2)`` is "0.50 GiB", ``format_bytes(n, "MiB", 0)`` "512 MiB")."""
    if unit is None:
        unit = next((u for u in ("B", "KiB", "MiB") if abs(n) < 1024 * BYTE_UNITS[u]), "GiB")
    if digits is None:
        digits = 0 if unit == "B" else 1
    return f"{n / BYTE_UNITS[unit]:.{digits}f} {unit}"


# What a spreadsheet reads as the start of a formula in a cell (OWASP: CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """A CSV text cell shown as written: one a spreadsheet would take for a formula (a class
    folder named ``=1+2``) gets a leading apostrophe. Numbers are not text cells."""
    return "'" + value if value.startswith(FORMULA_STARTS) else value

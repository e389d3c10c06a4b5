"""A run owns its checkpoint folder: one run at a time, and never another run's results silently.

``FolderLock`` is an OS file lock on ``<checkpoint_dir>/.lock`` that the kernel drops when the
process dies; ``check_new_run`` stops a run without ``--resume`` in a folder holding another
run's results; ``claim_run_folder`` does both on the main process and shares the verdict with
every rank. Only the standard library and ``errors``: the launcher runs these checks without torch.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import logging
import os
import re
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from imgtrainer.errors import UserError

log = logging.getLogger(__name__)


LOCK_NAME = ".lock"


# What a run leaves in --checkpoint_dir (``checkpoints.writer``) and in --log_dir
# (``reports.history``).
LATEST_NAME, BEST_NAME = "checkpoint_latest.pth", "checkpoint_best.pth"


PREVIOUS_NAME = "checkpoint_latest.prev.pth"  # the latest that the newest one replaced
CHECKPOINT_FILES = (LATEST_NAME, PREVIOUS_NAME, BEST_NAME)


# The epochs' checkpoints kept by --keep_checkpoints / --save_every_epochs.
EPOCH_NAME = re.compile(r"checkpoint_epoch_(\d+)\.pth")


def epoch_checkpoint_name(epoch: int) -> str:
    return f"checkpoint_epoch_{epoch:03d}.pth"


def epoch_checkpoints(folder: Path) -> dict[int, Path]:
    """The kept epochs' checkpoints in ``folder``, by epoch."""
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = EPOCH_NAME.fullmatch(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


HISTORY_NAME = "training_history.json"


# errno values of a file system without flock (some network file systems).
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


class FolderBusy(UserError):
    """Another live process holds the folder's lock."""


def check_checkpoint_dir(folder: Path) -> None:
    """``--checkpoint_dir`` must be a folder (or not exist yet), never a file."""
    if folder.exists() and not folder.is_dir():
        raise UserError(
            f"--checkpoint_dir {folder} is a file, not a folder; give a folder "
            "for the checkpoints (it is created if missing)"
        )


_held: dict[tuple[int, int], str] = {}  # this process's locks: (device, inode) -> holder line
os.register_at_fork(after_in_child=_held.clear)  # a forked child holds none of them


class FolderLock:
    """A POSIX record lock (``fcntl.lockf``) on ``folder/.lock``: this process's alone, so a
    child it forks never holds it (not even one wedged at its birth, before any of its Python
    ran: CPython before 3.11.8 can deadlock there), and the kernel drops it when the process
    dies. ``acquire`` raises ``FolderBusy`` naming the holder. Nothing else in the holding
    process may open the file: closing any descriptor of it drops the lock."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK_NAME
        self._fd: int | None = None
        self._key = (0, 0)

    def acquire(self) -> None:
        check_checkpoint_dir(self.path.parent)
        # This process's own lock refused from memory: opening and closing the file would drop it.
        with contextlib.suppress(OSError):
            found = os.stat(self.path)
            if (found.st_dev, found.st_ino) in _held:
                raise folder_busy(self.path.parent, _held[found.st_dev, found.st_ino])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # No O_TRUNC: opening must not erase the holder's pid before we know we are not it.
            # Never through a link planted in a shared folder: its target would be truncated.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file")
        except OSError as err:
            raise UserError(
                f"cannot create the lock file {self.path} in --checkpoint_dir: "
                f"{err.strerror or err}; remove it if it is a link, or choose a folder you can "
                "write to"
            ) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in NO_LOCKS:
                log.warning(
                    f"the file system of {self.path.parent} does not support "
                    "file locks: nothing stops a second run from using it at the same "
                    "time"
                )
                return
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise folder_busy(self.path.parent, read_holder(self.path)) from None
        started = datetime.datetime.now().isoformat(timespec="seconds")
        holder = f"pid {os.getpid()} on host {socket.gethostname()}, started {started}"
        found = os.fstat(fd)
        self._fd, self._key = fd, (found.st_dev, found.st_ino)
        _held[self._key] = holder
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{holder}\n".encode())
        except OSError:
            pass  # a full disk: the lock holds all the same; only the holder's name is missing

    def release(self) -> None:
        # The file stays: deleting a lock file races with a process that has just opened it.
        if self._fd is not None:
            _held.pop(self._key, None)
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def folder_busy(folder: Path, holder: str) -> FolderBusy:
    return FolderBusy(
        f"--checkpoint_dir {folder} is in use by another run ({holder}); wait "
        "for it to finish or stop it, or give another --checkpoint_dir"
    )


def read_holder(lock_path: Path) -> str:
    """What the holding run wrote in its lock file, e.g. 'pid 123 on host a, started ...'."""
    try:
        text = lock_path.read_text().strip()
    except OSError:
        text = ""
    return text or "its pid is not written yet"


def explicit_resume_file(resume: str) -> Path:
    """The checkpoint ``--resume PATH`` names (not ``auto``); one line if there is no such file.
    Torch-free, so the launcher checks it before starting the workers, which check it again."""
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"--resume {resume}: no such file")
    return path


def previous_run_files(checkpoint_dir: Path, log_dir: Path) -> list[Path]:
    """The checkpoints and the history an earlier run left in these folders."""
    found = [checkpoint_dir / name for name in CHECKPOINT_FILES]
    found.extend(epoch_checkpoints(checkpoint_dir).values())
    found.append(log_dir / HISTORY_NAME)
    return [path for path in found if path.is_file()]


def check_new_run(checkpoint_dir: Path, log_dir: Path, resume: str | None, overwrite: bool) -> None:
    """A run may write into folders holding an earlier run's results only if it continues that
    run (``--resume auto`` finding a checkpoint there, or ``--resume`` one of that folder's
    checkpoints) or was told to start over (``--overwrite``)."""
    if overwrite:
        return
    found = previous_run_files(checkpoint_dir, log_dir)
    checkpoints = [path for path in found if path.parent == checkpoint_dir]
    # --resume auto continues from the latest checkpoint (or its fallback), never from the best
    # or a kept epoch's.
    continues = (
        resume == "auto"
        and any(path.name in CHECKPOINT_FILES[:2] for path in checkpoints)
        or resume not in (None, "auto")
        and Path(resume).resolve().parent == checkpoint_dir.resolve()
    )
    if continues or not found:
        return
    if resume is None:
        start = "a new run"
    elif resume == "auto":
        start = f"--resume auto found no checkpoint to continue in {checkpoint_dir}, and a new run"
    else:
        start = f"--resume {resume} continues a checkpoint of another folder, and this run"
    choices = ["--resume auto to continue that run"] if checkpoints and resume is None else []
    choices.append("--overwrite to start over and replace them")
    folders = " and ".join(
        flag
        for flag, used in (
            ("--checkpoint_dir", checkpoints),
            ("--log_dir", len(found) > len(checkpoints)),
        )
        if used
    )
    raise UserError(
        f"{start} would replace the results of an earlier run "
        f"({', '.join(str(path) for path in found)}): add {', '.join(choices)}, or "
        f"give another {folders}"
    )


@contextlib.contextmanager
def claim_run_folder(
    checkpoint_dir: Path,
    check: Callable[[], None] | None,
    *,
    enabled: bool,
    agree: Callable[[str | None], str | None] = lambda error: error,
) -> Iterator[None]:
    """Lock ``checkpoint_dir`` for the duration of the block and run ``check`` (e.g.
    ``check_new_run``; None skips it) to decide that the run may write there. Only the process
    that writes checkpoints (``enabled``) looks; ``agree`` must run on every process and return
    that process's verdict (None, or the error line), so all of them raise the same
    ``UserError`` together and none waits for a process that already left.
    """
    lock = FolderLock(checkpoint_dir)
    error: str | None = None
    if enabled:
        try:
            lock.acquire()
            if check is not None:
                check()
        except UserError as err:
            lock.release()
            error = str(err)
    try:
        error = agree(error)
    except BaseException:
        lock.release()
        raise
    if error is not None:
        lock.release()
        raise UserError(error)
    try:
        yield
    finally:
        lock.release()

"""Checkpoints and the run's records in object storage (``--checkpoint_dir s3://bucket/run``).

Rank 0 writes each checkpoint to a local copy of the folder as always (``<log_dir>/checkpoints``),
and a background thread uploads it: training waits for the local write only. The store's put is
atomic (an object appears whole or not at all), so a killed upload leaves the previous
``checkpoint_latest.pth``, the one ``--resume auto`` downloads. No torch here.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from imgtrainer.checkpoints.run_folder import (
    CHECKPOINT_FILES,
    EPOCH_NAME,
    HISTORY_NAME,
    LATEST_NAME,
    PREVIOUS_NAME,
    check_new_run,
)
from imgtrainer.config import TrainConfig
from imgtrainer.errors import UserError, first_line
from imgtrainer.storage import Store, is_url

log = logging.getLogger(__name__)

RECORDS = (HISTORY_NAME, "metrics.csv", "config.yaml")  # from --log_dir to <url>/logs/
LOCAL_COPY = "checkpoints"  # in --log_dir: the local copy of a checkpoint folder in a store


def local_checkpoint_dir(checkpoint_dir: str, log_dir: str) -> Path:
    """Where this machine writes the checkpoints: --checkpoint_dir itself, or for a URL its
    local copy in --log_dir."""
    return Path(log_dir) / LOCAL_COPY if is_url(checkpoint_dir) else Path(checkpoint_dir)


def _url(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


def remote_run_files(url: str, store: Store) -> list[str]:
    """The checkpoints and the history an earlier run left at ``url``."""
    names = {u.rsplit("/", 1)[-1]: u for u in store.listing(url, recursive=True)}
    found = [names[n] for n in CHECKPOINT_FILES if n in names]
    found += [u for n, u in sorted(names.items()) if EPOCH_NAME.fullmatch(n)]
    return found + [names[n] for n in (HISTORY_NAME,) if n in names]


def check_new_remote_run(url: str, store: Store, resume: str | None, overwrite: bool) -> None:
    """``check_new_run`` for a folder in a store: never over an earlier run's results unless
    the run continues it (--resume auto) or starts over (--overwrite)."""
    if overwrite:
        return
    found = remote_run_files(url, store)
    latest = any(u.endswith((LATEST_NAME, PREVIOUS_NAME)) for u in found)
    if not found or (resume == "auto" and latest):
        return
    start = "a new run" if resume is None else f"--resume {resume} with this --checkpoint_dir"
    choices = "--resume auto to continue that run, " if latest and resume is None else ""
    raise UserError(
        f"{start} would replace the results of an earlier run ({', '.join(found)}): add "
        f"{choices}--overwrite to start over and replace them, or give another --checkpoint_dir"
    )


def checkpoint_folder(cfg: TrainConfig) -> Path:
    """``local_checkpoint_dir`` of the run's flags."""
    return local_checkpoint_dir(cfg.checkpoint_dir, cfg.log_dir)


def checkpoint_store(cfg: TrainConfig) -> Store:
    """The store of a --checkpoint_dir URL (--storage_options; no byte cache)."""
    return Store(options=cfg.storage_options)


def check_run_folders(cfg: TrainConfig) -> None:
    """``check_new_run`` on the local folder (the copy, for a URL), and for a URL on the store."""
    local = checkpoint_folder(cfg)
    check_new_run(local, Path(cfg.log_dir), cfg.resume, cfg.overwrite)
    if is_url(cfg.checkpoint_dir):
        store = checkpoint_store(cfg)
        check_new_remote_run(cfg.checkpoint_dir, store, cfg.resume, cfg.overwrite)


def check_checkpoint_url(cfg: TrainConfig) -> None:
    """The launcher's check of a --checkpoint_dir in a store: reachable and writable now (one
    line for no credentials, a missing bucket, an endpoint that does not answer)."""
    if is_url(cfg.checkpoint_dir):
        checkpoint_store(cfg).check_writable(cfg.checkpoint_dir)


DOWNLOADED = ".store-latest.pth"  # the store's newest, compared with the local copy's


def fetch_latest(url: str, store: Store, local: Path) -> str | None:
    """Download the newest checkpoint at ``url`` (``checkpoint_latest.pth``, else its kept
    previous one) into ``local`` as ``DOWNLOADED``; its URL, or None when there is none."""
    names = {u.rsplit("/", 1)[-1] for u in store.listing(url, missing_ok=True)}
    for name in (LATEST_NAME, PREVIOUS_NAME):
        if name in names:
            store.get_file(_url(url, name), local / DOWNLOADED)
            return _url(url, name)
    return None


def remove_leftovers(local: Path) -> None:
    """The snapshots of uploads and the downloads a killed run left in its local copy: each
    kept a replaced checkpoint's blocks alive."""
    for path in [*local.glob(".upload-*.pth"), local / DOWNLOADED]:
        path.unlink(missing_ok=True)


@dataclass
class Upload:
    """One checkpoint's uploads: ``snapshot`` (a second name of the local latest at the save)
    as the latest, then copies in the store (best, kept epochs), removals, the records.
    ``earlier``: snapshots of checkpoints it replaced in the queue, each to upload under the
    names their own copies gave them (a best epoch's, a kept epoch's)."""

    snapshot: Path | None
    copies: list[str] = field(default_factory=list)
    removals: list[str] = field(default_factory=list)
    records: dict[str, bytes] = field(default_factory=dict)
    replace_previous_run: bool = False  # --overwrite's first checkpoint: the earlier run's go
    earlier: dict[str, Path] = field(default_factory=dict)

    def after(self, queued: Upload) -> Upload:
        """This upload in place of ``queued``, still waiting: one checkpoint on the disk and
        one upload instead of two, and what ``queued`` named that this one does not name again
        uploaded from its snapshot."""
        names = set(self.copies) | set(self.removals)
        kept = {n: p for n, p in queued.earlier.items() if n not in names}
        kept |= {n: queued.snapshot for n in queued.copies if n not in names and queued.snapshot}
        for path in {*queued.earlier.values(), queued.snapshot} - {*kept.values(), None}:
            path.unlink(missing_ok=True)
        self.earlier = kept
        self.removals = [n for n in queued.removals if n not in self.copies] + self.removals
        self.replace_previous_run |= queued.replace_previous_run
        return self

    def files(self) -> set[Path]:
        return {p for p in (self.snapshot, *self.earlier.values()) if p is not None}


class CheckpointMirror:
    """Uploads the checkpoints written to ``local`` to ``url`` in a background thread, in
    the order they were written; does nothing where not ``enabled`` (every rank but 0). At most
    one upload waits behind the one under way: a newer checkpoint takes its place. An upload
    that fails is one warning; the next checkpoint is uploaded whole all the same."""

    def __init__(self, url: str, local: Path, log_dir: Path, store: Store, enabled: bool):
        self.url, self.local, self.log_dir = url, local, log_dir
        self.store, self.enabled = store, enabled
        self.pending: Upload | None = None
        self.busy = False
        self.changed = threading.Condition()
        self.failed: str | None = None
        self.count = 0
        self.thread: threading.Thread | None = None
        if enabled:
            remove_leftovers(local)

    def target(self, name: str) -> str:
        return _url(self.url, name)

    def submit(self, upload: Upload) -> None:
        if not self.enabled:
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True, name="upload")
            self.thread.start()
        with self.changed:
            self.pending = upload.after(self.pending) if self.pending else upload
            self.changed.notify_all()

    def snapshot(self, latest: Path) -> Path:
        """A second name of the latest checkpoint just written (or a copy): what is uploaded
        stays this checkpoint while training writes the next."""
        self.count += 1
        path = self.local / f".upload-{os.getpid()}-{self.count}.pth"
        path.unlink(missing_ok=True)
        try:
            os.link(latest, path)
        except OSError:
            path.write_bytes(latest.read_bytes())
        return path

    def records(self) -> dict[str, bytes]:
        """The run's records as they are now, for ``<url>/logs/``."""
        found = {}
        for name in RECORDS:
            try:
                found[name] = (self.log_dir / name).read_bytes()
            except OSError:
                continue
        return found

    def _next(self) -> Upload | None:
        """The waiting upload, once there is one; None once the mirror is closed."""
        with self.changed:
            while self.pending is None and self.thread is not None:
                self.changed.wait()
            upload, self.pending = self.pending, None
            self.busy = upload is not None
            return upload

    def _run(self) -> None:
        while (upload := self._next()) is not None:
            try:
                self._upload(upload)
                self.failed = None
            except Exception as err:  # the store gone for now: the next checkpoint tries again
                self.failed = first_line(err)
                log.warning(f"could not upload to {self.url} ({self.failed}); the checkpoints "
                            f"are in {self.local}, the next one is uploaded again")  # fmt: skip
            finally:
                for path in upload.files():
                    path.unlink(missing_ok=True)
                with self.changed:
                    self.busy = False
                    self.changed.notify_all()

    def _upload(self, upload: Upload) -> None:
        store = self.store
        if upload.snapshot is not None:
            latest = self.target(LATEST_NAME)
            if not upload.replace_previous_run:
                try:
                    store.copy(latest, self.target(PREVIOUS_NAME))
                except FileNotFoundError:
                    pass  # the first checkpoint
            store.put_file(upload.snapshot, latest)  # atomic: the old latest or the new one
        if upload.replace_previous_run:
            for url in remote_run_files(self.url, store):
                if not url.endswith((LATEST_NAME, HISTORY_NAME)):
                    store.remove(url)
        for name, path in upload.earlier.items():  # a replaced checkpoint's best or kept epoch
            store.put_file(path, self.target(name))
        for name in upload.copies:
            store.copy(self.target(LATEST_NAME), self.target(name))
        for name in upload.removals:
            store.remove(self.target(name))
        for name, data in upload.records.items():
            store.put_bytes(self.target(f"logs/{name}"), data)

    def flush(self) -> None:
        """Wait for the uploads queued so far (the end of a run)."""
        if self.thread is not None:
            with self.changed:
                while self.pending is not None or self.busy:
                    self.changed.wait()
            if self.failed:
                log.warning(f"the last upload to {self.url} failed ({self.failed}); "
                            f"the newest checkpoint is in {self.local}")  # fmt: skip

    def close(self) -> None:
        self.flush()
        if self.thread is not None:
            thread, self.thread = self.thread, None
            with self.changed:
                self.changed.notify_all()
            thread.join()

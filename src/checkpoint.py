"""Checkpoint files: crash-safe writes, safe loads, the latest/best policy and resume lookup.

A checkpoint is a plain dict of tensors and primitives (see ``train_ddp.checkpoint_state``),
saved from the unwrapped model, so ``torch.load(path, weights_only=True)`` loads it and its
``model_state_dict`` loads into a plain model with ``strict=True``.
"""
from __future__ import annotations

import logging
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from errors import UserError

log = logging.getLogger("trainer")

LATEST = "checkpoint_latest.pth"
BEST = "checkpoint_best.pth"


class CheckpointError(UserError):
    """A checkpoint file that is missing, corrupt, or refused as unsafe."""


def previous_path(path: Path) -> Path:
    """Where the checkpoint that ``path`` replaced is kept: checkpoint_latest.prev.pth."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def atomic_save(obj: Any, path: Path, keep_previous: bool = False) -> None:
    """Write to a temporary file in the same folder, fsync, then rename into place.

    A crash at any moment leaves either the old file or the new one, never a torn one. With
    ``keep_previous`` the file being replaced is kept as ``previous_path(path)``, so a latest
    checkpoint damaged later (a bad disk, a truncated copy) still has a fallback.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if keep_previous and path.exists():
        os.replace(path, previous_path(path))
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the renames themselves durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint_file(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` with one clear error for every way a file can be bad."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with warnings.catch_warnings():
            # torch warns about the pickle protocol of any non-zip file before failing on it;
            # the error below says what the file is.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as err:  # a damaged file can make the unpickler raise almost anything
        raise _load_error(path, err) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, not a dict")
    return obj


def _load_error(path: Path, err: Exception) -> CheckpointError:
    """Name what is wrong with a file that ``torch.load`` refused."""
    message = str(err)
    if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in message:
        # A real pickle naming classes or functions: loading it could run code.
        return CheckpointError(
            f"refused to load {path}: it contains Python objects other than tensors and "
            "plain values, which could run code when unpickled (loaded with "
            "weights_only=True); only load checkpoints from sources you trust")
    if not zipfile.is_zipfile(path):
        # torch.save writes a zip archive (since torch 1.6); its index sits at the end, so a
        # truncated copy is no longer a zip either.
        return CheckpointError(f"{path} is not a readable PyTorch checkpoint: corrupt or "
                               f"truncated, or another kind of file ({path.stat().st_size} "
                               "bytes); give a .pth file written by src/train_ddp.py")
    first_line = message.splitlines()[0] if message else type(err).__name__
    return CheckpointError(f"checkpoint {path} is corrupt ({first_line})")


def load_training_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint to resume from: ``path``, or the copy it replaced if ``path`` is damaged."""
    try:
        state = load_checkpoint_file(path)
    except CheckpointError as err:
        fallback = previous_path(path)
        if not fallback.is_file():
            raise
        log.warning(f"WARNING: {err}; falling back to the previous checkpoint {fallback}")
        state = load_checkpoint_file(fallback)
    missing = {"model_state_dict", "optimizer_state_dict", "epoch"} - state.keys()
    if missing:
        raise CheckpointError(f"{path} is not a training checkpoint of this trainer "
                              f"(missing {sorted(missing)})")
    return state


def check_resume_fits(state: dict[str, Any], path: Path, class_names: list[str],
                      model_name: str, optimizer: str) -> None:
    """A checkpoint continues only the run it came from: same classes, model and optimizer."""
    saved_classes = state.get("class_names")
    if saved_classes is not None and saved_classes != class_names:
        only_saved = sorted(set(saved_classes) - set(class_names))
        only_data = sorted(set(class_names) - set(saved_classes))
        raise CheckpointError(f"--resume {path} was trained on {len(saved_classes)} other classes "
                              f"than the data's {len(class_names)} (only in the checkpoint: "
                              f"{only_saved[:5] or 'none'}; only in the data: "
                              f"{only_data[:5] or 'none'}); point --train_dir/--val_dir at the "
                              "same dataset or start a new run")
    saved = state.get("config", {})
    for flag, value in (("model", model_name), ("optimizer", optimizer)):
        if saved.get(flag, value) != value:
            raise CheckpointError(f"--resume {path} was trained with --{flag} {saved[flag]}, "
                                  f"not --{flag} {value}; resume with the same --{flag}")


def find_resume_checkpoint(resume: str | None, checkpoint_dir: Path) -> Path | None:
    """The file ``--resume`` points at: ``auto`` means the newest checkpoint, if there is one."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_file():
            raise CheckpointError(f"--resume {path}: no such file")
        return path
    latest = checkpoint_dir / LATEST
    if latest.is_file() or previous_path(latest).is_file():
        return latest
    log.info(f"--resume auto: no checkpoint in {checkpoint_dir}, starting a new run")
    return None


class CheckpointWriter:
    """Writes latest/best checkpoints; a no-op on every process but the main one."""

    def __init__(self, checkpoint_dir: Path, enabled: bool):
        self.dir = checkpoint_dir
        self.enabled = enabled

    @property
    def latest(self) -> Path:
        return self.dir / LATEST

    @property
    def best(self) -> Path:
        return self.dir / BEST

    def save(self, state: dict[str, Any], is_best: bool) -> None:
        if not self.enabled:
            return
        atomic_save(state, self.latest, keep_previous=True)
        if is_best:
            atomic_save(state, self.best)

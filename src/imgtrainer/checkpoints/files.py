"""Checkpoint files: crash-safe writes, safe loads, the latest/best policy and resume lookup.

A checkpoint is a plain dict of tensors and primitives (keys in ``CHECKPOINT_SCHEMA``), loadable
with ``weights_only=True``; ``format_version`` says which schema wrote it (none: version 0).
"""

from __future__ import annotations

import logging
import pickle
import re
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from imgtrainer.errors import UserError, message_line
from imgtrainer.files import atomic_write

log = logging.getLogger(__name__)


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a tensor, or in a nested dict, list, tuple or other iterable
    of them (other values count 0): a step's memory, about what ``torch.save`` writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class CheckpointError(UserError):
    """A checkpoint file that is missing, corrupt, or refused as unsafe."""


# Raise when a key's meaning changes or a key the loaders need is added; older files stay
# readable (their missing keys are read with defaults where they are read), newer ones are refused.
CHECKPOINT_FORMAT = 2


# Every key a training checkpoint holds, with what it holds.
CHECKPOINT_SCHEMA = {
    "format_version": "CHECKPOINT_FORMAT of the trainer that wrote it",
    "model_state_dict": "the unwrapped model's weights and buffers",
    "state_dict": "the same dict, under the key timm's load_checkpoint / validate.py / "
    "create_model(checkpoint_path=) read (torch.save stores each tensor once)",
    "model_ema_state_dict": "with --model_ema: the exponential moving average of the weights and "
    "buffers (src/ema.py), with model_state_dict's keys, so it loads into the same plain model; "
    "None without EMA",
    "state_dict_ema": "the same dict, under the key timm's loaders prefer (use_ema=True, their "
    "default); None without EMA",
    "ema_updates": "EMA updates done: the position of its warm-up (None without EMA)",
    "best_weights": "which weights scored the better --best_metric (val_acc by default) at the "
    "last evaluation: 'ema' (model_ema_state_dict) or 'raw' (model_state_dict); in "
    "checkpoint_best.pth the ones that scored best_value. None before the first evaluation",
    "optimizer_state_dict": "optimizer.state_dict()",
    "scheduler_state_dict": "scheduler.state_dict()",
    "scaler_state_dict": "GradScaler.state_dict(), or None without float16 loss scaling",
    "epoch": "epochs completed",
    "step": "optimizer steps done in the next epoch",
    "epoch_position": "samples of the next epoch's global order consumed (step x "
    "effective_batch_size): where a resume on any number of processes continues (absent in "
    "older files: step x their effective batch)",
    "micro_batch": "images per forward/backward pass",
    "best_acc": "the best val_acc so far (with EMA: of the raw or the EMA weights, the higher), "
    "whatever --best_metric chooses",
    "best_metric": "--best_metric: the history key that chooses checkpoint_best.pth (absent: "
    "val_acc)",
    "best_value": "the best value of best_metric so far (None before the first validation)",
    "best_epoch": "the first epoch that scored best_value: checkpoint_best.pth's",
    "early_stopping": "{'reference': the value early stopping last saw improve by more than "
    "--early_stopping_min_delta, 'wait': validated epochs since then}",
    "class_names": "index -> class name, the order of the model's outputs",
    "image_size": "the side of the training crops",
    "mean": "normalisation mean",
    "std": "normalisation std",
    "model_name": "the timm model name",
    "config": "TrainConfig.to_dict() of the run, its flags as given (a resume compares its own "
    "with them)",
    "world_size": "processes that wrote it",
    "layout": "batch_size, accum_steps and world_size that made the global batch when it was "
    "written (the flags' own, or chosen for another world size; absent in older files: config's)",
    "effective_batch_size": "images per optimizer step over all processes, the run's constant: "
    "layout batch_size x accum_steps x world_size (absent before --accum_steps counted batches "
    "per step: then batch_size alone was a process's step)",
    "history": "the history records up to this checkpoint",
    "rank_states": "per rank: RNG states and running epoch metrics (``rank_state``)",
}


# What resuming needs, and what the inference tools need.
# The type each key's value must have where it is present (None allowed): a file of another
# shape is refused with one line, whatever reads it next.
CHECKPOINT_TYPES: dict[str, type | tuple[type, ...]] = {
    **dict.fromkeys(
        ("model_state_dict", "state_dict", "model_ema_state_dict", "state_dict_ema"), dict
    ),
    **dict.fromkeys(
        ("optimizer_state_dict", "scheduler_state_dict", "scaler_state_dict", "config"), dict
    ),
    **dict.fromkeys(("layout", "early_stopping"), dict),
    **dict.fromkeys(("epoch", "step", "epoch_position", "micro_batch", "ema_updates"), int),
    **dict.fromkeys(("best_epoch", "image_size", "world_size", "effective_batch_size"), int),
    **dict.fromkeys(("best_acc", "best_value"), (int, float)),
    **dict.fromkeys(("best_weights", "best_metric", "model_name"), str),
    **dict.fromkeys(("class_names", "mean", "std", "history", "rank_states"), (list, tuple)),
}


def check_checkpoint_shape(state: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose known keys hold values of other types (hand-made, or another
    tool's file under a known name): one line naming the key."""
    for key, kind in CHECKPOINT_TYPES.items():
        value = state.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise CheckpointError(
                f"checkpoint {path} is not one of src/train_ddp.py: its {key!r} holds a "
                f"{type(value).__name__}"
            )
    names = state.get("class_names") or []
    if not all(isinstance(name, str) for name in names):
        raise CheckpointError(f"checkpoint {path} is not one of src/train_ddp.py: its class names")


RESUME_KEYS = ("model_state_dict", "optimizer_state_dict", "epoch")


INFERENCE_KEYS = ("model_state_dict", "class_names", "image_size", "model_name")


def training_checkpoint(**fields: Any) -> dict[str, Any]:
    """The checkpoint dict: exactly the schema's keys (a bug otherwise), this format's version."""
    state = {"format_version": CHECKPOINT_FORMAT, **fields}
    if state.keys() != CHECKPOINT_SCHEMA.keys():
        raise ValueError(
            f"checkpoint keys differ from CHECKPOINT_SCHEMA: missing "
            f"{sorted(CHECKPOINT_SCHEMA.keys() - state.keys())}, unknown "
            f"{sorted(state.keys() - CHECKPOINT_SCHEMA.keys())}"
        )
    return state


class NewerFormatError(CheckpointError):
    """A checkpoint of a newer format: not damaged, so no fallback to the previous file."""


def check_format_version(state: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint written by a newer trainer, whose keys may mean other things."""
    version = state.get("format_version", 0)
    if not isinstance(version, int) or version > CHECKPOINT_FORMAT:
        raise NewerFormatError(
            f"checkpoint {path} has format version {version}, newer than "
            f"this trainer's {CHECKPOINT_FORMAT}: it was written by a newer "
            "version of this project; update the code to load it"
        )


def previous_path(path: Path) -> Path:
    """Where the checkpoint that ``path`` replaced is kept: checkpoint_latest.prev.pth."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def atomic_save(obj: Any, path: Path, keep_previous: bool = False) -> None:
    """Write to a temporary file in the same folder, fsync, then rename into place.

    A crash at any moment leaves either the old file or the new one, never a torn one. With
    ``keep_previous`` the file being replaced is kept as ``previous_path(path)``, so a latest
    checkpoint damaged later (a bad disk, a truncated copy) still has a fallback. A full disk is
    one error line naming the file and the space it needs; the partial file is removed and the
    checkpoints already there are left as they were.
    """
    atomic_write(
        path,
        lambda f: torch.save(obj, f),
        lambda: tensor_bytes(obj),
        keep_previous_as=previous_path(path) if keep_previous else None,
    )


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
    check_format_version(obj, path)
    check_checkpoint_shape(obj, path)
    return obj


# How torch words a weights-only refusal of code, in any version: "Unsupported global: GLOBAL
# x.Y was not an allowed global", "unsupported GLOBAL posix.system whose module posix is
# blocked". (A damaged file fails there too, as "Unsupported operand": not refused, corrupt.)
REFUSED = re.compile(r"unsupported global|\bglobal\b", re.IGNORECASE)


def _load_error(path: Path, err: Exception) -> CheckpointError:
    """Name what is wrong with a file that ``torch.load`` refused."""
    message = str(err)
    if isinstance(err, pickle.UnpicklingError) and REFUSED.search(message):
        # torch's weights-only unpickler refused it: it names code (a class, a function, a
        # blocked module), whatever torch's wording. Never torch's advice to load it unsafely.
        return CheckpointError(
            f"refused to load {path}: it holds code or objects that could run code when "
            "unpickled, so it was not loaded (weights_only=True); only load checkpoints from "
            "sources you trust"
        )
    if not zipfile.is_zipfile(path):
        # torch.save writes a zip archive (since torch 1.6); its index sits at the end, so a
        # truncated copy is no longer a zip either.
        return CheckpointError(
            f"{path} is not a readable PyTorch checkpoint: corrupt or "
            f"truncated, or another kind of file ({path.stat().st_size} "
            "bytes); give a .pth file written by src/train_ddp.py"
        )
    return CheckpointError(
        f"checkpoint {path} is corrupt ({message_line(message) or type(err).__name__})"
    )


def load_training_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint to resume from: ``path``, or the copy it replaced if ``path`` is damaged."""
    try:
        state = load_checkpoint_file(path)
    except CheckpointError as err:
        fallback = previous_path(path)
        if isinstance(err, NewerFormatError) or not fallback.is_file():
            raise
        log.warning(f"{err}; falling back to the previous checkpoint {fallback}")
        state = load_checkpoint_file(fallback)
    missing = set(RESUME_KEYS) - state.keys()
    if missing:
        raise CheckpointError(
            f"{path} is not a training checkpoint of this trainer (missing {sorted(missing)})"
        )
    return state

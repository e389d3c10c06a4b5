"""Checkpoint files: crash-safe writes, safe loads, the latest/best policy and resume lookup.

A checkpoint is a plain dict of tensors and primitives, its keys listed once in
``CHECKPOINT_SCHEMA`` and put together by ``training_checkpoint``, saved from the unwrapped model,
so ``torch.load(path, weights_only=True)`` loads it and its ``model_state_dict`` loads into a
plain model with ``strict=True``. ``format_version`` says which schema wrote it: a file of a newer
one is refused on load with one line; a file without one (written before versions existed) is
version 0, whose keys are those of version 1. Version 2: the config's ``accum_steps`` counts
batches of ``batch_size`` per optimizer step (in versions 0 and 1 it split ``batch_size`` into
micro-batches), and ``effective_batch_size`` says what a step was (``saved_step_batch``).
"""

from __future__ import annotations

import logging
import pickle
import random
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from errors import UserError
from run_folder import BEST_NAME, LATEST_NAME, atomic_link, atomic_write

log = logging.getLogger(f"trainer.{__name__}")  # under the project logger

LATEST, BEST = LATEST_NAME, BEST_NAME


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
    "best_weights": "which weights scored the higher val_acc at the last evaluation: 'ema' "
    "(model_ema_state_dict) or 'raw' (model_state_dict); in checkpoint_best.pth the ones that "
    "scored best_acc. None before the first evaluation",
    "optimizer_state_dict": "optimizer.state_dict()",
    "scheduler_state_dict": "scheduler.state_dict()",
    "scaler_state_dict": "GradScaler.state_dict(), or None without float16 loss scaling",
    "epoch": "epochs completed",
    "step": "optimizer steps done in the next epoch",
    "micro_batch": "images per forward/backward pass",
    "best_acc": "the best val_acc so far (with EMA: of the raw or the EMA weights, the higher)",
    "class_names": "index -> class name, the order of the model's outputs",
    "image_size": "the side of the training crops",
    "mean": "normalisation mean",
    "std": "normalisation std",
    "model_name": "the timm model name",
    "config": "TrainConfig.to_dict() of the run",
    "world_size": "processes that wrote it",
    "effective_batch_size": "images per optimizer step over all processes: config batch_size x "
    "accum_steps x world_size (absent before --accum_steps counted batches per step: then "
    "batch_size alone was a process's step)",
    "history": "the history records up to this checkpoint",
    "rank_states": "per rank: RNG states and running epoch metrics (``rank_state``)",
}
# What resuming needs, and what the inference tools need.
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


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a nested structure: about what ``torch.save`` writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


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
    return obj


def _load_error(path: Path, err: Exception) -> CheckpointError:
    """Name what is wrong with a file that ``torch.load`` refused."""
    message = str(err)
    if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in message:
        # A real pickle naming classes or functions: loading it could run code.
        return CheckpointError(
            f"refused to load {path}: it contains Python objects other than tensors and "
            "plain values, which could run code when unpickled (loaded with "
            "weights_only=True); only load checkpoints from sources you trust"
        )
    if not zipfile.is_zipfile(path):
        # torch.save writes a zip archive (since torch 1.6); its index sits at the end, so a
        # truncated copy is no longer a zip either.
        return CheckpointError(
            f"{path} is not a readable PyTorch checkpoint: corrupt or "
            f"truncated, or another kind of file ({path.stat().st_size} "
            "bytes); give a .pth file written by src/train_ddp.py"
        )
    first_line = message.splitlines()[0] if message else type(err).__name__
    return CheckpointError(f"checkpoint {path} is corrupt ({first_line})")


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


def check_resume_fits(
    state: dict[str, Any], path: Path, class_names: list[str], model_name: str, optimizer: str
) -> None:
    """A checkpoint continues only the run it came from: same classes, model and optimizer."""
    saved_classes = state.get("class_names")
    if saved_classes is not None and saved_classes != class_names:
        only_saved = sorted(set(saved_classes) - set(class_names))
        only_data = sorted(set(class_names) - set(saved_classes))
        raise CheckpointError(
            f"--resume {path} was trained on {len(saved_classes)} other classes "
            f"than the data's {len(class_names)} (only in the checkpoint: "
            f"{only_saved[:5] or 'none'}; only in the data: "
            f"{only_data[:5] or 'none'}); point --train_dir/--val_dir at the "
            "same dataset or start a new run"
        )
    saved = state.get("config", {})
    for flag, value in (("model", model_name), ("optimizer", optimizer)):
        if saved.get(flag, value) != value:
            raise CheckpointError(
                f"--resume {path} was trained with --{flag} {saved[flag]}, "
                f"not --{flag} {value}; resume with the same --{flag}"
            )


# Flags that change what the optimisation does: resuming under other values is silently another
# run. --epochs may grow (continuing a finished run); --optimizer is checked above (its state does
# not carry over to another optimizer); the effective batch is compared in ``changed_settings``. Mixup/cutmix
# change the loss's targets, like label smoothing, and --mix_off_epochs is a schedule; the
# per-image augmentation (crop, flip, --auto_augment, --random_erasing) is not checked.
SCHEDULE_FLAGS = (
    "learning_rate",
    "lr_scaling",
    "scheduler",
    "warmup_epochs",
    "step_size",
    "gamma",
    "weight_decay",
    "momentum",
    "label_smoothing",
    "decay_norm_and_bias",
    "clip_grad_norm",
    "head_lr_scale",
    "freeze_backbone_epochs",
    "mixup",
    "cutmix",
    "mix_switch_prob",
    "mix_off_epochs",
    "ema_decay",
)
# What a checkpoint written before a flag existed ran with: its config lacks the key.
VALUES_BEFORE_FLAG = {
    "decay_norm_and_bias": True,  # weight decay was on every parameter
    "clip_grad_norm": 0.0,
    "head_lr_scale": 1.0,
    "freeze_backbone_epochs": 0,
}


def _step_schedule(saved: dict[str, Any], new: dict[str, Any]) -> bool:
    return "step" in (saved.get("scheduler"), new["scheduler"])


def _mixing(config: dict[str, Any]) -> bool:
    return config.get("mixup", 0) > 0 or config.get("cutmix", 0) > 0


# The schedule flags that only some settings read: (saved config, new config) -> whether a
# change of the flag changes the run.
READ_ONLY_WHEN: dict[str, Callable[[dict[str, Any], dict[str, Any]], bool]] = {
    "step_size": _step_schedule,
    "gamma": _step_schedule,
    "momentum": lambda saved, new: new["optimizer"] == "sgd",
    "mix_switch_prob": lambda saved, new: all(  # the choice between mixup and cutmix
        c.get("mixup", 0) > 0 and c.get("cutmix", 0) > 0 for c in (saved, new)
    ),
    "mix_off_epochs": lambda saved, new: _mixing(saved) or _mixing(new),
    "ema_decay": lambda saved, new: bool(saved.get("model_ema") and new.get("model_ema")),
}


def saved_world_size(state: dict[str, Any]) -> int | None:
    """How many processes wrote the checkpoint (older ones record it as their rank states)."""
    return state.get("world_size") or len(state.get("rank_states") or []) or None


def saved_step_batch(state: dict[str, Any]) -> tuple[int, int] | None:
    """(--batch_size, --accum_steps) that make up one process's optimizer step in the run that
    wrote ``state``, or None if it does not say. A checkpoint without ``effective_batch_size``
    was written when --accum_steps split --batch_size into micro-batches: its step was
    --batch_size images whatever --accum_steps said, which counts here as K = 1."""
    saved = state.get("config") or {}
    if "batch_size" not in saved:
        return None
    if "effective_batch_size" not in state:
        return saved["batch_size"], 1
    return saved["batch_size"], saved.get("accum_steps", 1)


def changed_settings(state: dict[str, Any], config: dict[str, Any], world_size: int) -> list[str]:
    """``--flag saved -> new`` for each flag that changes the schedule or the optimisation."""
    saved = state.get("config") or {}
    if saved:  # a config without a flag's key was written before the flag existed
        saved = {**VALUES_BEFORE_FLAG, **saved}
    changes = []
    for flag in SCHEDULE_FLAGS:
        if flag not in saved or saved[flag] == config[flag]:
            continue
        if flag in READ_ONLY_WHEN and not READ_ONLY_WHEN[flag](saved, config):
            continue  # not read with these settings
        changes.append(f"--{flag} {saved[flag]} -> {config[flag]}")
    processes, step = saved_world_size(state), saved_step_batch(state)
    if step and processes:
        (batch, accum), new_accum = step, config["accum_steps"]
        before, after = batch * accum * processes, config["batch_size"] * new_accum * world_size
        if before != after:
            changes.append(
                f"effective batch per optimizer step (--batch_size x --accum_steps x "
                f"processes) {batch}x{accum}x{processes}={before} -> "
                f"{config['batch_size']}x{new_accum}x{world_size}={after}"
                + _old_accum_hint(saved, state)
            )
    return changes


def _old_accum_hint(saved: dict[str, Any], state: dict[str, Any]) -> str:
    """For a checkpoint written when --accum_steps K split --batch_size: the flags that keep its
    batch now (--batch_size B --accum_steps K then is --batch_size B/K --accum_steps K now)."""
    old_accum = saved.get("accum_steps", 1)
    if "effective_batch_size" in state or old_accum == 1:
        return ""
    hint = (
        f" (the checkpoint is from before --accum_steps counted batches per step: its "
        f"--batch_size {saved['batch_size']} --accum_steps {old_accum} was "
        f"{saved['batch_size']} images per step"
    )
    if saved["batch_size"] % old_accum == 0:
        hint += (
            f", which --batch_size {saved['batch_size'] // old_accum} --accum_steps "
            f"{old_accum} gives now"
        )
    return hint + ")"


def check_resume_settings(
    state: dict[str, Any], path: Path, config: dict[str, Any], world_size: int, override: bool
) -> list[str]:
    """Refuse a resume whose flags change the run's schedule or optimisation, unless
    ``override``; returns the changes (to apply and log)."""
    changes = changed_settings(state, config, world_size)
    if changes and not override:
        raise CheckpointError(
            f"--resume {path}: these flags differ from the run being resumed "
            f"and would change its schedule or optimisation: "
            f"{'; '.join(changes)}; resume with the saved values, or add "
            "--resume_override to apply the new ones"
        )
    return changes


def optimisation_settings(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR
) -> dict[str, Any]:
    """The hyperparameters a freshly built optimizer and scheduler hold (from the flags); taken
    before a checkpoint's state replaces them, to put them back under --resume_override."""
    keys = ("initial_lr", "weight_decay", "momentum")
    return {
        "groups": [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups],
        "base_lrs": list(scheduler.base_lrs),
    }


def apply_optimisation_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    settings: dict[str, Any],
) -> None:
    """Put the flags' hyperparameters back over a loaded state, keeping the optimizer's moments
    and the step count. The schedule's shape comes from the flags already (its lambda is built
    from them); its base learning rates and the learning rate of the next step are set here."""
    for group, fresh in zip(optimizer.param_groups, settings["groups"], strict=True):
        group.update(fresh)
    scheduler.base_lrs = list(settings["base_lrs"])
    # What LambdaLR.step() sets after ``last_epoch`` steps, under the new schedule.
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


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
    """Writes latest/best checkpoints; a no-op on every process but the main one.

    With ``replace_previous_run`` (``--overwrite``) the earlier run's checkpoints are removed at
    this run's first save, not before: a run that fails at start-up leaves them as they were.
    """

    def __init__(self, checkpoint_dir: Path, enabled: bool, replace_previous_run: bool = False):
        self.dir = checkpoint_dir
        self.enabled = enabled
        self.replace_previous_run = replace_previous_run

    @property
    def latest(self) -> Path:
        return self.dir / LATEST

    @property
    def best(self) -> Path:
        return self.dir / BEST

    def save(self, state: dict[str, Any], is_best: bool) -> None:
        if not self.enabled:
            return
        atomic_save(state, self.latest, keep_previous=not self.replace_previous_run)
        if self.replace_previous_run:
            # The earlier run's best and fallback must not pass for this run's. Removed once this
            # run's latest is written, so a failed first save leaves the earlier run whole.
            for old in (self.best, previous_path(self.latest)):
                old.unlink(missing_ok=True)
            self.replace_previous_run = False
        # The best checkpoint is the latest one, a second name of its file (0.3 s of writing
        # ResNet18's 134 MB saved per best epoch); a copy where hard links are not supported.
        if is_best and not atomic_link(self.latest, self.best):
            atomic_save(state, self.best)


# ----------------------------------------------------------------------------- rank state


def rank_state(sums: torch.Tensor | None, device: torch.device) -> dict[str, Any]:
    """This rank's random state and running epoch metrics, as tensors and plain values."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            *map(_plain, np_state[2:]),
        ),
        "train_sums": None if sums is None else sums.detach().cpu(),
    }
    if device.type == "cuda":  # this rank's GPU only: a resumed job may see fewer GPUs
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def restore_rank_state(state: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """Put back what ``rank_state`` saved; returns the running epoch metrics."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    return state["train_sums"]


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value

"""Resuming: the checks a checkpoint must pass, and each rank's saved state."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imgtrainer import torch_compat
from imgtrainer.checkpoints.files import CheckpointError, previous_path
from imgtrainer.checkpoints.run_folder import LATEST_NAME, explicit_resume_file
from imgtrainer.config import RESUME_CHECKED_FLAGS, Layout
from imgtrainer.data import class_difference, own_cpu_rng_state

log = logging.getLogger(__name__)


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


def check_resume_fits(
    state: dict[str, Any], path: Path, class_names: list[str], model_name: str, optimizer: str
) -> None:
    """A checkpoint continues only the run it came from: same classes, model and optimizer."""
    saved_classes = state.get("class_names")
    if saved_classes is not None and saved_classes != class_names:
        difference = class_difference(saved_classes, class_names, ("the checkpoint", "the data"))
        raise CheckpointError(
            f"--resume {path} was trained on {len(saved_classes)} other classes "
            f"than the data's {len(class_names)} ({difference}); point --train_dir/--val_dir at "
            "the same dataset or start a new run"
        )
    saved = state.get("config") or {}
    for flag, value in (("model", model_name), ("optimizer", optimizer)):
        if saved.get(flag, value) != value:
            raise CheckpointError(
                f"--resume {path} was trained with --{flag} {saved[flag]}, "
                f"not --{flag} {value}; resume with the same --{flag}"
            )


# Flags that change what the optimisation does: resuming under other values is silently another
# run. --epochs may grow (continuing a finished run); --optimizer is checked above (its state does
# not carry over to another optimizer); the effective batch is compared in ``changed_settings``. Mixup/cutmix
# change the loss's targets, like label smoothing and --class_weights, and --mix_off_epochs is a
# schedule; --sampler changes which images an epoch sees; the
# per-image augmentation (crop, flip, --auto_augment, --random_erasing) is not checked.
SCHEDULE_FLAGS = RESUME_CHECKED_FLAGS  # the fields of TrainConfig marked RESUME_CHECKED


# What a checkpoint written before a flag existed ran with: its config lacks the key.
VALUES_BEFORE_FLAG = {
    "decay_norm_and_bias": True,  # weight decay was on every parameter
    "clip_grad_norm": 0.0,
    "head_lr_scale": 1.0,
    "freeze_backbone_epochs": 0,
    "class_weights": "none",
    "sampler": "random",
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


def saved_global_batch(state: dict[str, Any]) -> int | None:
    """Images per optimizer step over all processes in the run that wrote ``state``."""
    if "effective_batch_size" in state:
        return state["effective_batch_size"]
    step, processes = saved_step_batch(state), saved_world_size(state)
    return Layout(*step, processes).global_batch if step and processes else None


def _saved_layout_text(state: dict[str, Any]) -> str:
    """The saved layout, short; "?" where the checkpoint does not say."""
    saved = state.get("layout") or {}
    numbers = [saved.get(key) for key in ("batch_size", "accum_steps", "world_size")]
    if not all(numbers):
        step, processes = saved_step_batch(state), saved_world_size(state)
        numbers = [*step, processes] if step and processes else []
    try:
        return Layout(*numbers).short()
    except (TypeError, ValueError):
        return "?"


def requested_global_batch(
    state: dict[str, Any], config: dict[str, Any], world_size: int
) -> tuple[int, str]:
    """The global batch that the new flags ask for, and how they ask for it. It is the saved
    one when they do not change it: --global_batch_size the same, or --batch_size and
    --accum_steps those of the run (another world size then changes only the layout). Other
    per-process flags ask for batch_size x accum_steps x the new world size."""
    saved = state.get("config") or {}
    if config.get("global_batch_size"):
        return config["global_batch_size"], f"--global_batch_size {config['global_batch_size']}"
    same_flags = all(saved.get(k) == config[k] for k in ("batch_size", "accum_steps"))
    if same_flags and "effective_batch_size" in state and not saved.get("global_batch_size"):
        return state["effective_batch_size"], "the same flags"
    layout = Layout(config["batch_size"], config["accum_steps"], world_size)
    return layout.global_batch, layout.short()


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
    before = saved_global_batch(state)
    if before:
        after, asked = requested_global_batch(state, config, world_size)
        if before != after:
            changes.append(
                f"effective batch per optimizer step (--batch_size x --accum_steps x "
                f"processes) {_saved_layout_text(state)} -> {asked}" + _old_accum_hint(saved, state)
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


def check_best_metric(state: dict[str, Any], path: Path, metric: str, override: bool) -> None:
    """Another --best_metric makes the saved best checkpoint and patience count another
    metric's: refused unless ``override`` (then they are recomputed from the history)."""
    saved = state.get("best_metric", "val_acc")  # what the trainer chose before the flag
    if saved == metric:
        return
    if not override:
        raise CheckpointError(
            f"--resume {path}: the run being resumed chose its best checkpoint by "
            f"--best_metric {saved}, not {metric}; resume with --best_metric {saved}, or add "
            "--resume_override to rank its epochs by the new metric from here on"
        )
    log.info(
        f"--resume_override: --best_metric {saved} -> {metric}; best epoch and patience "
        f"recomputed from the history (checkpoint_best.pth keeps its {saved} best until a new "
        "best epoch)"
    )


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
    torch_compat.set_scheduler_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])


def find_resume_checkpoint(resume: str | None, checkpoint_dir: Path) -> Path | None:
    """The file ``--resume`` points at: ``auto`` means the newest checkpoint, if there is one."""
    if resume is None:
        return None
    if resume != "auto":
        return explicit_resume_file(resume)
    latest = checkpoint_dir / LATEST_NAME
    if latest.is_file() or previous_path(latest).is_file():
        return latest
    log.info(f"--resume auto: no checkpoint in {checkpoint_dir}, starting a new run")
    return None


# ----------------------------------------------------------------------------- rank state


def rank_state(sums: torch.Tensor | None, device: torch.device) -> dict[str, Any]:
    """This rank's random state and running epoch metrics, as tensors and plain values."""
    np_state = np.random.get_state()
    state = {
        "torch": own_cpu_rng_state(),
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

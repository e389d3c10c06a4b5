"""Every training option in one frozen dataclass, the argparse parser built from it, and presets.

The config is parsed once in ``main()``, validated, printed, and then only read. It is saved as a
plain dict in every checkpoint and in the history file. This module does not import torch, so the
launcher can show the trainer's ``--help`` quickly.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imgtrainer.errors import UserError
from imgtrainer.process import TorchrunEnv

# --device of the trainer, the launcher and the inference tools (``distributed.setup.choose_device``).
DEVICE_CHOICES = ["auto", "cuda", "cpu"]


# --best_metric: history keys of a validation; "lower" or "higher" is better.
BEST_METRICS = {
    "val_acc": "higher",
    "val_loss": "lower",
    "val_top5": "higher",
    "val_acc_ema": "higher",
    "val_loss_ema": "lower",
    "val_top5_ema": "higher",
}


# --log_to's names, and the module (in reports/trackers) of each one's Tracker.
TRACKERS = {"wandb": "wandb_tracker", "mlflow": "mlflow_tracker"}


def tracker_names(value: str) -> list[str]:
    """``--log_to``'s comma-separated names, checked; [] for "" or "none"."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if names == ["none"]:
        return []
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise UserError(
            f"--log_to: unknown tracker {unknown[0]!r}; choose from {', '.join(TRACKERS)} "
            "(comma-separated; metrics.csv is always written)"
        )
    if len(set(names)) != len(names):
        raise UserError(f"--log_to names a tracker twice: {value}")
    return names


def _opt(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    """A dataclass field that also carries its command-line help."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass(frozen=True)
class TrainConfig:
    """Every training flag; HELP_GROUPS groups them for ``--help``."""

    train_dir: str = _opt("data/train", "training ImageFolder: <dir>/<class>/<image>")
    val_dir: str = _opt("data/val", "validation ImageFolder with the same class folders")
    image_size: int = _opt(224, "side of the square crop fed to the model, in pixels")
    eval_resize_ratio: float = _opt(
        0.875,
        "validation: resize the short side to image_size / R, then centre-crop image_size "
        "(timm's crop_pct; 1.0: no margin cropped); stored in the checkpoint for "
        "evaluate.py / predict.py",
    )
    num_workers: int | None = _opt(
        None,
        "loader worker processes per training process (default: from the CPU cores per "
        "process and the image source: none for the GPU cache, more for files than for RAM)",
    )
    cache_images: str = _opt(
        "auto",
        "decode every image once and keep it in memory: ram, gpu "
        "(on the device), none (read the files every epoch), or auto "
        "(gpu when it fits in a quarter of the free device memory, "
        "else ram when it fits in a quarter of the free memory)",
        choices=["auto", "none", "ram", "gpu"],
    )
    prefetch_factor: int = _opt(2, "batches each loader worker prepares ahead")
    crop_scale_min: float = _opt(0.08, "smallest area fraction kept by RandomResizedCrop")
    hflip: float = _opt(0.5, "probability of a horizontal flip in training")
    auto_augment: str = _opt(
        "none",
        "per-image policy after the crop and flip: trivialaugment (TrivialAugmentWide), "
        "randaugment (RandAugment, 2 ops at magnitude 9) or none",
        choices=["none", "trivialaugment", "randaugment"],
    )
    random_erasing: float = _opt(
        0.0,
        "probability of erasing a random rectangle of each training image "
        "(filled with the mean colour: 0 after normalization)",
    )
    mixup: float = _opt(0.0, "mixup alpha: blend image pairs with Beta(alpha, alpha) (0: off)")
    cutmix: float = _opt(0.0, "cutmix alpha: paste a box of the paired image (0: off)")
    mix_switch_prob: float = _opt(
        0.5, "with both --mixup and --cutmix, the probability that a batch uses cutmix"
    )
    mix_off_epochs: int = _opt(0, "turn mixup/cutmix off for the last N epochs")
    model: str = _opt("resnet18", "any timm model name")
    pretrained: bool = _opt(False, "start from timm's pretrained weights (needs network access)")
    pretrained_path: str | None = _opt(
        None, "local timm/torchvision state dict to start from (the classifier head is replaced)"
    )
    sync_bn: bool = _opt(False, "convert BatchNorm to SyncBatchNorm across processes")
    compile: bool = _opt(
        False, "compile the model with torch.compile (slow first steps, faster after)"
    )
    grad_checkpointing: bool = _opt(
        False,
        "activation checkpointing where timm supports it: "
        "recompute activations in backward instead of "
        "keeping them (less memory, slower steps)",
    )
    model_ema: bool = _opt(
        False,
        "keep an exponential moving average (EMA) of the weights and BatchNorm "
        "statistics, updated after every optimizer step taken; evaluated next to the "
        "weights every epoch (val_acc_ema, ...) and saved as model_ema_state_dict",
    )
    ema_decay: float = _opt(
        0.999,
        "the EMA's decay per optimizer step, after a warm-up: update n uses "
        "min(ema_decay, 1 - n^-0.75), so 0.999 is reached after 10,000 steps",
    )
    epochs: int = _opt(50, "number of epochs")
    batch_size: int = _opt(
        32, "images per forward/backward pass in each process; a step takes --accum_steps of them"
    )
    accum_steps: int = _opt(
        1,
        "gradient accumulation: batches of --batch_size per optimizer step in each "
        "process (gradients exchanged once per step); effective batch = batch_size x "
        "accum_steps x processes",
    )
    global_batch_size: int | None = _opt(
        None,
        "images per optimizer step over all processes, kept when a resume or an elastic "
        "restart runs on another number of processes: --accum_steps (and where it must "
        "--batch_size, as the largest pass that divides a process's share) are chosen to "
        "make it (default: batch_size x accum_steps x processes of the run's first start)",
    )
    learning_rate: float = _opt(0.001, "peak learning rate (before --lr_scaling)")
    weight_decay: float = _opt(0.01, "weight decay")
    optimizer: str = _opt("adamw", "optimizer", choices=["adamw", "sgd"])
    momentum: float = _opt(0.9, "momentum for sgd")
    scheduler: str = _opt(
        "cosine",
        "learning-rate schedule, stepped every optimizer step",
        choices=["cosine", "step", "none"],
    )
    warmup_epochs: float = _opt(0.0, "linear warm-up length in epochs (fractions allowed)")
    step_size: int = _opt(30, "epochs between decays for --scheduler step")
    gamma: float = _opt(0.1, "decay factor for --scheduler step")
    lr_scaling: str = _opt(
        "none",
        "scale the learning rate by the effective batch's ratio to --batch_size, "
        "R = accum_steps x processes: linear (lr*R) or sqrt (lr*sqrt(R))",
        choices=["none", "linear", "sqrt"],
    )
    label_smoothing: float = _opt(0.0, "label smoothing of the training loss")
    class_weights: str = _opt(
        "none",
        "weight each class in the training loss: balanced: n_images / (n_classes x the "
        "class's images), scikit-learn's formula; none: every image counts the same",
        choices=["none", "balanced"],
    )
    sampler: str = _opt(
        "random",
        "training order: random (each image once per epoch, shuffled) or balanced (an "
        "epoch of the same length drawing every class equally often: small classes' "
        "images repeat, large classes' are subsampled)",
        choices=["random", "balanced"],
    )
    decay_norm_and_bias: bool = _opt(
        False,
        "weight decay on every parameter; by default normalisation weights and biases "
        "(every 1-D parameter, timm's filter) get none",
    )
    clip_grad_norm: float = _opt(
        0.0,
        "clip the gradient's total L2 norm to this before each optimizer step (0: off); "
        "unscaled first under AMP, once per step across micro-batches",
    )
    head_lr_scale: float = _opt(
        1.0, "the classifier head's learning rate is K times the rest's (fine-tuning)"
    )
    freeze_backbone_epochs: int = _opt(
        0,
        "train only the classifier head for the first N epochs (the backbone's learning "
        "rate is 0; its BatchNorm statistics still adapt), then every layer",
    )
    use_amp: bool = _opt(
        False,
        "automatic mixed precision (float16 + GradScaler on CUDA; "
        "bfloat16 on the CPU, usually slower there)",
    )
    amp_dtype: str = _opt("float16", "autocast dtype on CUDA", choices=["float16", "bfloat16"])
    device: str = _opt("auto", "auto: CUDA when visible, else the CPU", choices=DEVICE_CHOICES)
    channels_last: bool = _opt(
        True,
        "channels_last memory format on CUDA (faster tensor-core "
        "convolutions; ignored on the CPU; --no_channels_last: off)",
    )
    low_memory: bool = _opt(
        False,
        "preset for small GPUs (2 GB): --use_amp --channels_last "
        "--grad_checkpointing (of the early, high-resolution layers only) "
        "--auto_micro_batch --prefetch_factor 1; on the CPU it trains in float32. "
        "Flags given explicitly win",
    )
    auto_micro_batch: bool = _opt(
        False,
        "before training, find the largest micro-batch (from "
        "--batch_size, halving) that fits in "
        "--max_memory_gb; on out-of-memory during training, "
        "halve it and redo the step",
    )
    max_memory_gb: float | None = _opt(
        None,
        "memory budget per process for --auto_micro_batch, in GiB (default and most: the "
        "device's memory divided by the processes using it)",
    )
    checkpoint_dir: str = _opt(
        "checkpoints", "where checkpoint_latest.pth / checkpoint_best.pth go"
    )
    log_dir: str = _opt("logs", "where training_history.json and per-rank logs go")
    log_interval: int = _opt(
        20,
        "steps between progress-bar metric updates, or plain lines where the console is not "
        "a terminal (each one syncs)",
    )
    seed: int = _opt(42, "seed of sample order, augmentation and initial weights")
    resume: str | None = _opt(
        None,
        "continue from this checkpoint, or 'auto': the newest one in "
        "--checkpoint_dir if any, else start fresh",
    )
    overwrite: bool = _opt(
        False,
        "start a new run in a --checkpoint_dir / --log_dir that hold an "
        "earlier run's results, replacing its checkpoints and "
        "training_history.json (at this run's first checkpoint); "
        "without it such a start is refused",
    )
    resume_override: bool = _opt(
        False,
        "when resuming, apply flags that change the schedule or "
        "the optimisation (learning rate, scheduler, warm-up, "
        "weight decay and its grouping, momentum, label smoothing, "
        "mixup/cutmix, gradient clipping, head learning rate, frozen "
        "epochs, batch per step, class weights, sampler) instead of refusing them",
    )
    tensorboard: bool = _opt(
        True,
        "write TensorBoard event files (curves, hyper-parameters, a "
        "grid of augmented images) to <log_dir>/tensorboard on the "
        "main process; --no_tensorboard: off",
    )
    log_to: str = _opt(
        "none",
        "also send the curves to these experiment trackers, comma-separated: wandb, mlflow "
        "(main process; each needs its package, and its login unless offline: "
        "WANDB_MODE=offline, MLflow's local store); <log_dir>/metrics.csv is always written",
    )
    save_every_steps: int = _opt(
        0, "also write checkpoint_latest.pth every N steps inside an epoch (0: only at epoch end)"
    )
    deterministic: bool = _opt(
        False, "deterministic algorithms: bitwise-reproducible runs and resumes (slower on CUDA)"
    )
    check_sync: bool = _opt(
        False, "after every epoch, verify that all ranks hold identical parameters and buffers"
    )
    val_every_epochs: int = _opt(
        1, "validate every N epochs (the last epoch always); only validated epochs count as best"
    )
    best_metric: str = _opt(
        "val_acc",
        "the validation metric that picks checkpoint_best.pth and drives early stopping "
        "(val_loss: lower is better); with --model_ema, val_acc/val_loss/val_top5 take the "
        "better of the raw and EMA weights, the *_ema ones the EMA weights alone",
        choices=list(BEST_METRICS),
    )
    early_stopping_patience: int = _opt(
        0,
        "stop when --best_metric has not improved for N validated epochs in a row (0: off); "
        "exit code 0, the summary says so",
    )
    early_stopping_min_delta: float = _opt(
        0.0,
        "with --early_stopping_patience: a change of --best_metric smaller than this is no "
        "improvement",
    )
    keep_checkpoints: int = _opt(
        0,
        "also keep the K best epochs' checkpoints by --best_metric as "
        "checkpoint_epoch_NNN.pth (hard links where possible; 0: only latest and best)",
    )
    save_every_epochs: int = _opt(
        0, "also keep checkpoint_epoch_NNN.pth of every Nth epoch, whatever its score (0: off)"
    )
    max_time: str | None = _opt(
        None,
        "time budget of this run, e.g. 2h30m, 90m, 45s, 3600 (seconds) or DD:HH:MM:SS: stop "
        "with a checkpoint and the resume command while one still fits; exit code 0",
    )
    demo: bool = _opt(False, "write the bundled digits demo data to data/demo and train on it")
    distributed: bool = _opt(
        False, "accepted for compatibility; distribution follows torchrun's environment"
    )
    dist_timeout_minutes: float = _opt(
        30.0, "process-group timeout: a hung rank fails the job after this long"
    )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Defaults that suit the bundled demo (8x8 digit scans written as 32 px PNGs). Flags the user
# gives explicitly still win over these.
DEMO_PRESET: dict[str, Any] = {
    "train_dir": "data/demo/train",
    "val_dir": "data/demo/val",
    "image_size": 32,
    "epochs": 12,
    "batch_size": 64,
    "learning_rate": 0.003,
    "weight_decay": 0.05,
    "warmup_epochs": 1.0,
    "crop_scale_min": 0.7,
    "hflip": 0.0,  # a flipped digit is a different digit
    # The demo keeps its results apart, and a second --demo trains again from scratch (what
    # running a demo twice should show) instead of replacing a real run's results or printing
    # "done" at once. --resume auto continues an interrupted demo instead.
    "checkpoint_dir": "checkpoints/demo",
    "log_dir": "logs/demo",
    "overwrite": True,
}


# What a 2 GB GPU needs, without changing the batch size (the training itself). Flags the user
# gives explicitly still win (``--no_<flag>`` turns a switch of the preset off). The parts that
# only make sense on CUDA are decided with the device: ``use_amp`` and ``channels_last`` do
# nothing on the CPU under this preset (bfloat16 autocast is much slower there, and the
# micro-batches already bound the memory).
LOW_MEMORY_PRESET: dict[str, Any] = {
    "use_amp": True,  # float16 activations: about half the activation memory
    "channels_last": True,  # the layout float16 convolutions run fastest in
    "grad_checkpointing": True,  # keep only block inputs; recompute the rest in backward
    "auto_micro_batch": True,  # find the largest micro-batch that fits; halve on OOM
    "prefetch_factor": 1,  # each loader worker holds one batch ahead, not two
}


# The flag that switches each preset on, and the preset.
PRESETS: dict[str, dict[str, Any]] = {"demo": DEMO_PRESET, "low_memory": LOW_MEMORY_PRESET}


# Switches that are on by default, or that a preset turns on, get a --no_<name> flag, so an
# explicit flag can turn them off.
NEGATABLE = sorted(
    {name for preset in PRESETS.values() for name, value in preset.items() if value is True}
    | {f.name for f in dataclasses.fields(TrainConfig) if f.default is True}
)


# How ``--help`` groups the flags; every field of TrainConfig is in exactly one group.
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "data": (
        "train_dir",
        "val_dir",
        "demo",
        "image_size",
        "eval_resize_ratio",
        "num_workers",
        "cache_images",
        "prefetch_factor",
    ),
    "augmentation": (
        "crop_scale_min",
        "hflip",
        "auto_augment",
        "random_erasing",
        "mixup",
        "cutmix",
        "mix_switch_prob",
        "mix_off_epochs",
    ),
    "model": ("model", "pretrained", "pretrained_path", "compile", "model_ema", "ema_decay"),
    "optimisation": (
        "epochs",
        "batch_size",
        "accum_steps",
        "global_batch_size",
        "learning_rate",
        "weight_decay",
        "optimizer",
        "momentum",
        "scheduler",
        "warmup_epochs",
        "step_size",
        "gamma",
        "lr_scaling",
        "label_smoothing",
        "decay_norm_and_bias",
        "clip_grad_norm",
        "head_lr_scale",
        "freeze_backbone_epochs",
    ),
    "class imbalance": ("class_weights", "sampler"),
    "precision and memory": (
        "use_amp",
        "amp_dtype",
        "channels_last",
        "low_memory",
        "auto_micro_batch",
        "max_memory_gb",
        "grad_checkpointing",
    ),
    "distributed": ("device", "sync_bn", "dist_timeout_minutes", "check_sync", "distributed"),
    "checkpoints and logging": (
        "checkpoint_dir",
        "log_dir",
        "log_interval",
        "resume",
        "resume_override",
        "overwrite",
        "save_every_steps",
        "tensorboard",
        "log_to",
        "seed",
        "deterministic",
    ),
    "validation, stopping and checkpoint history": (
        "val_every_epochs",
        "best_metric",
        "early_stopping_patience",
        "early_stopping_min_delta",
        "keep_checkpoints",
        "save_every_epochs",
        "max_time",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """One ``--flag`` per field, in HELP_GROUPS's groups; every default is SUPPRESS so we can
    tell what the user typed."""
    parser = argparse.ArgumentParser(
        prog="train_ddp.py",
        description="Train an image classifier on an ImageFolder dataset, on 1..N processes.",
        argument_default=argparse.SUPPRESS,
    )
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    run_files = parser.add_argument_group("run files")
    for action in run_file_parser()._actions:
        run_files.add_argument(
            *action.option_strings,
            help=action.help,
            **({"action": "store_true"} if action.nargs == 0 else {}),
        )
    for title, names in HELP_GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            _add_flag(group, fields[name])
    return parser


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    meta = dict(f.metadata)
    help_text = f"{meta.pop('help')} (default: {f.default})"
    flag = f"--{f.name}"
    if f.type in ("bool", bool):
        group.add_argument(flag, action="store_true", help=help_text)
        if f.name in NEGATABLE:
            group.add_argument(
                f"--no_{f.name}",
                dest=f.name,
                action="store_false",
                help=f"turn --{f.name} off (a preset may turn it on)",
            )
    else:
        group.add_argument(flag, type=_field_type(f), help=help_text, **meta)


def _field_type(f: dataclasses.Field) -> type:
    name = str(f.type).replace(" | None", "")
    return {"int": int, "float": float, "str": str}[name]


# Flags of launch_ddp.py that a run file may also hold (the launcher reads them; the trainer
# accepts and ignores them, so one file serves both), with the YAML types each accepts.
LAUNCHER_KEYS: dict[str, tuple[type, ...]] = {
    "num_gpus": (int, str),
    "nproc": (int,),
    "nnodes": (int, str),
    "node_rank": (int,),
    "master_addr": (str,),
    "master_port": (int,),
    "rdzv_id": (str,),
    "rdzv_endpoint": (str,),
    "rdzv_conf": (str,),
    "max_restarts": (int,),
    "start_method": (str,),
}


def run_file_parser() -> argparse.ArgumentParser:
    """The flags that name a run file or print the resolved configuration; understood by the
    launcher and the trainer alike, before their other flags."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML run file: keys are flag names (trainer or launcher); flags "
        "on the command line win",
    )
    parser.add_argument(
        "--print_config",
        action="store_true",
        help="print the resolved configuration as YAML and exit",
    )
    return parser


@functools.cache
def _run_file_loader() -> type:
    """YAML's safe loader, except that colon numbers (``1:30:00``) stay text: YAML 1.1 reads them
    in base 60, so ``2:00:00:00`` would be 432,000 s instead of the 2 days it is on the command
    line, and ``1:30`` 90 s instead of being refused as there."""
    import yaml

    class RunFileLoader(yaml.SafeLoader):
        pass

    colon_number = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-9_]+)+(?:\.[0-9_]*)?$")
    RunFileLoader.yaml_implicit_resolvers = {
        first: [("tag:yaml.org,2002:str", colon_number), *resolvers]
        if first in "+-0123456789"
        else resolvers
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    return RunFileLoader


def read_run_file(path: Path) -> dict[str, Any]:
    """The flag values of a YAML run file, each checked against its flag's type, or one error
    naming the key and the file."""
    import yaml  # only runs that name a file pay for the import

    try:
        data = yaml.load(path.read_text(), _run_file_loader()) if path.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(
            f"--config {path}: not a readable YAML file ({str(err).splitlines()[0]})"
        ) from None
    if not path.is_file():
        raise UserError(f"--config {path}: no such file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"--config {path}: expected a mapping of flag names to values, found "
            f"a {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        if key in LAUNCHER_KEYS:
            expected = LAUNCHER_KEYS[key]
            if not isinstance(value, expected) or isinstance(value, bool):
                raise UserError(
                    f"--config {path}: {key} must be "
                    f"{' or '.join(t.__name__ for t in expected)}, got {value!r}"
                )
        elif key in fields:
            value = _checked_file_value(path, fields[key], value)
        else:
            close = difflib.get_close_matches(key.replace("-", "_"), [*fields, *LAUNCHER_KEYS], n=1)
            raise UserError(
                f"--config {path}: unknown key '{key}'"
                + (
                    f" (did you mean '{close[0]}'?)"
                    if close
                    else "; keys are the flag names without '--', see --help"
                )
            )
        values[key] = value
    return values


# Flags holding a duration (parse_duration): a run file's number is their seconds.
DURATION_FIELDS = frozenset({"max_time"})


def _checked_file_value(path: Path, f: dataclasses.Field, value: Any) -> Any:
    """``value`` as the field's type (YAML's 3 becomes 3.0 for a float flag), or one error."""
    type_name = str(f.type)
    optional = "None" in type_name
    if value is None and optional:
        return None
    if f.name in DURATION_FIELDS and isinstance(value, int | float) and not isinstance(value, bool):
        # Seconds, as on the command line (colon forms stay text: _run_file_loader).
        value = str(value)
    kind = _field_type(f) if type_name.replace(" | None", "") != "bool" else bool
    # YAML reads 3 as an int: accept it for a float, but never a bool for a number.
    accepted = (int, float) if kind is float else (kind,)
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        raise UserError(
            f"--config {path}: {f.name} must be {kind.__name__}"
            f"{' or null' if optional else ''}, got {value!r}"
        )
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise UserError(
            f"--config {path}: {f.name} must be one of {', '.join(choices)}, got {value!r}"
        )
    return float(value) if kind is float else value


def parse_config(argv: Sequence[str] | None = None, env: TorchrunEnv | None = None) -> TrainConfig:
    """Defaults, then the presets switched on, then the run file (``--config``), then what the
    user typed explicitly: the command line wins."""
    run_flags, rest = run_file_parser().parse_known_args(argv)
    from_file = read_run_file(run_flags.config) if run_flags.config else {}
    explicit = vars(build_parser().parse_args(rest))
    chosen = {**from_file, **explicit}
    values: dict[str, Any] = {}
    for switch, preset in PRESETS.items():
        if chosen.get(switch):
            values.update(preset)
    values.update({k: v for k, v in from_file.items() if k not in LAUNCHER_KEYS})
    values.update(explicit)
    if (
        chosen.get("demo")
        and "overwrite" not in chosen
        and (chosen.get("resume") or "checkpoint_dir" in chosen or "log_dir" in chosen)
    ):
        # The demo starts over only in its own folders, and never when asked to resume.
        values["overwrite"] = False
    cfg = TrainConfig(**values)
    validate(cfg)
    return with_global_batch_layout(cfg, set(explicit), env or TorchrunEnv())


def with_global_batch_layout(cfg: TrainConfig, given: set[str], env: TorchrunEnv) -> TrainConfig:
    """With --global_batch_size, the --batch_size and --accum_steps that make it at this start's
    world size. Flags typed explicitly are kept; at a fresh start (not a resume, not a restarted
    worker) flags that cannot make it are refused. A resume at another world size lays the run
    out again (``training.trainer``)."""
    if cfg.global_batch_size is None:
        return cfg
    world = env.world_size
    fresh = cfg.resume is None and env.first_attempt
    fixed = {name: getattr(cfg, name) for name in ("batch_size", "accum_steps") if name in given}
    try:
        layout = choose_layout(cfg.global_batch_size, world, cfg.batch_size, fixed)
    except LayoutContradiction as err:
        if fresh:
            raise UserError(str(err)) from None
        layout = choose_layout(cfg.global_batch_size, world, cfg.batch_size)
    return dataclasses.replace(cfg, batch_size=layout.batch_size, accum_steps=layout.accum_steps)


# ----------------------------------------------------------------------------- global batch


@dataclass(frozen=True)
class Layout:
    """How one optimizer step's global batch is made: passes of ``batch_size`` images,
    ``accum_steps`` of them per process, on ``world_size`` processes."""

    batch_size: int
    accum_steps: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accum_steps * self.world_size

    def describe(self) -> str:
        return (
            f"--batch_size {self.batch_size} x --accum_steps {self.accum_steps} x "
            f"{self.world_size} process(es) = {self.global_batch}"
        )


class LayoutContradiction(UserError):
    """Explicit --batch_size/--accum_steps that cannot make --global_batch_size."""


def world_sizes_for(global_batch: int, limit: int = 12) -> str:
    """The numbers of processes that can share ``global_batch`` evenly (its divisors)."""
    sizes = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    return ", ".join(map(str, sizes[:limit])) + (", ..." if len(sizes) > limit else "")


def choose_layout(
    global_batch: int, world_size: int, max_pass: int, fixed: dict[str, int] | None = None
) -> Layout:
    """The layout that makes ``global_batch`` on ``world_size`` processes: the largest pass of
    at most ``max_pass`` images that divides a process's share, and as many accumulation steps
    as it takes; ``fixed`` (explicit flags) must be kept, or LayoutContradiction."""
    if global_batch % world_size:
        raise UserError(
            f"the global batch of {global_batch} images cannot be split evenly over "
            f"{world_size} processes; numbers of processes that can: "
            f"{world_sizes_for(global_batch)} (or resume with another --global_batch_size "
            "and --resume_override)"
        )
    share = global_batch // world_size
    fixed = fixed or {}
    if "accum_steps" in fixed and "batch_size" not in fixed and share % fixed["accum_steps"] == 0:
        return Layout(share // fixed["accum_steps"], fixed["accum_steps"], world_size)
    if "batch_size" in fixed and share % fixed["batch_size"] == 0:
        layout = Layout(fixed["batch_size"], share // fixed["batch_size"], world_size)
        if fixed.get("accum_steps", layout.accum_steps) == layout.accum_steps:
            return layout
    if fixed:
        given = " x ".join(f"--{name} {value}" for name, value in fixed.items())
        raise LayoutContradiction(
            f"--global_batch_size {global_batch} contradicts {given} on {world_size} "
            f"process(es) ({share} images per process and optimizer step); give "
            "--global_batch_size alone (the accumulation steps are then chosen), or a "
            f"--batch_size that divides {share}"
        )
    batch = max(d for d in range(1, min(max_pass, share) + 1) if share % d == 0)
    return Layout(batch, share // batch, world_size)


def print_config_requested(argv: Sequence[str] | None) -> bool:
    return run_file_parser().parse_known_args(argv)[0].print_config


# The launcher hands its resolved flags to the workers here (JSON), so the configuration a run
# writes repeats the launcher's part too.
LAUNCHER_FLAGS_ENV = "TRAIN_DDP_LAUNCHER_FLAGS"


def launcher_flags_from_env() -> dict[str, Any]:
    import json

    return json.loads(os.environ.get(LAUNCHER_FLAGS_ENV, "{}"))


def config_yaml(cfg: TrainConfig, launcher: dict[str, Any] | None = None) -> str:
    """The resolved configuration as a run file: ``--config`` of this text repeats the run."""
    import yaml

    header = "# Resolved configuration; rerun with: python launch_ddp.py --config <this file>\n"
    return header + yaml.safe_dump({**(launcher or {}), **cfg.to_dict()}, sort_keys=False)


def validate(cfg: TrainConfig) -> None:
    """Reject impossible combinations with one clear line."""
    positive = {
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "image_size": cfg.image_size,
        "learning_rate": cfg.learning_rate,
        "log_interval": cfg.log_interval,
        "dist_timeout_minutes": cfg.dist_timeout_minutes,
    }
    for name, value in positive.items():
        if value <= 0:
            raise UserError(f"--{name} must be positive, got {value}")
    if cfg.save_every_steps < 0:
        raise UserError(f"--save_every_steps must be 0 or more, got {cfg.save_every_steps}")
    if cfg.num_workers is not None and cfg.num_workers < 0:
        raise UserError(f"--num_workers must be 0 or more, got {cfg.num_workers}")
    if cfg.warmup_epochs < 0 or cfg.warmup_epochs > cfg.epochs:
        raise UserError(
            f"--warmup_epochs must be between 0 and --epochs ({cfg.epochs}), "
            f"got {cfg.warmup_epochs}"
        )
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise UserError(f"--label_smoothing must be in [0, 1), got {cfg.label_smoothing}")
    if not 0.0 < cfg.eval_resize_ratio <= 1.0:
        raise UserError(
            f"--eval_resize_ratio must be in (0, 1] (the crop's share of the resized "
            f"image's short side), got {cfg.eval_resize_ratio}"
        )
    if cfg.clip_grad_norm < 0:
        raise UserError(f"--clip_grad_norm must be 0 (off) or positive, got {cfg.clip_grad_norm}")
    if cfg.head_lr_scale <= 0:
        raise UserError(f"--head_lr_scale must be positive, got {cfg.head_lr_scale}")
    if not 0 <= cfg.freeze_backbone_epochs <= cfg.epochs:
        raise UserError(
            f"--freeze_backbone_epochs must be between 0 and --epochs ({cfg.epochs}), "
            f"got {cfg.freeze_backbone_epochs}"
        )
    if not 0.0 < cfg.ema_decay < 1.0:
        raise UserError(f"--ema_decay must be in (0, 1), got {cfg.ema_decay}")
    if not 0.0 < cfg.crop_scale_min <= 1.0:
        raise UserError(f"--crop_scale_min must be in (0, 1], got {cfg.crop_scale_min}")
    for name in ("hflip", "random_erasing", "mix_switch_prob"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise UserError(f"--{name} is a probability in [0, 1], got {getattr(cfg, name)}")
    for name in ("mixup", "cutmix"):
        if getattr(cfg, name) < 0:
            raise UserError(
                f"--{name} is a Beta alpha: 0 (off) or positive, got {getattr(cfg, name)}"
            )
    if cfg.mix_off_epochs < 0:
        raise UserError(f"--mix_off_epochs must be 0 or more, got {cfg.mix_off_epochs}")
    if cfg.accum_steps < 1:
        raise UserError(f"--accum_steps must be at least 1, got {cfg.accum_steps}")
    if cfg.global_batch_size is not None and cfg.global_batch_size < 1:
        raise UserError(f"--global_batch_size must be positive, got {cfg.global_batch_size}")
    if cfg.prefetch_factor < 1:
        raise UserError(f"--prefetch_factor must be at least 1, got {cfg.prefetch_factor}")
    if cfg.max_memory_gb is not None:
        if cfg.max_memory_gb <= 0:
            raise UserError(f"--max_memory_gb must be positive, got {cfg.max_memory_gb}")
        if not cfg.auto_micro_batch:
            raise UserError(
                "--max_memory_gb is the budget of --auto_micro_batch; add "
                "--low_memory or --auto_micro_batch"
            )
    if cfg.sync_bn and cfg.auto_micro_batch:
        # SyncBatchNorm exchanges statistics inside every forward pass: ranks could neither try
        # micro-batch sizes on their own nor redo a step after one of them ran out of memory.
        raise UserError(
            "--sync_bn cannot be combined with --auto_micro_batch (part of "
            "--low_memory); choose the size of each pass with --batch_size (and add "
            "--accum_steps for a larger step) instead, or add --no_auto_micro_batch"
        )
    if cfg.overwrite and cfg.resume == "auto":
        raise UserError(
            "--overwrite starts a new run and --resume auto continues the one in "
            "--checkpoint_dir: give one of them"
        )
    if cfg.resume_override and cfg.resume is None:
        raise UserError(
            "--resume_override applies new flags to a resumed run; add --resume auto "
            "(or --resume PATH)"
        )
    tracker_names(cfg.log_to)
    if cfg.pretrained and cfg.pretrained_path:
        raise UserError("give either --pretrained (download) or --pretrained_path FILE, not both")
    validate_stopping(cfg)


def validate_stopping(cfg: TrainConfig) -> None:
    """The flags of validation, best checkpoint, early stopping and checkpoint history."""
    for name in ("early_stopping_patience", "keep_checkpoints", "save_every_epochs"):
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} must be 0 (off) or more, got {getattr(cfg, name)}")
    if cfg.val_every_epochs < 1:
        raise UserError(f"--val_every_epochs must be at least 1, got {cfg.val_every_epochs}")
    if cfg.early_stopping_min_delta < 0:
        raise UserError(
            f"--early_stopping_min_delta must be 0 or more, got {cfg.early_stopping_min_delta}"
        )
    if cfg.early_stopping_min_delta and not cfg.early_stopping_patience:
        raise UserError(
            "--early_stopping_min_delta is a setting of early stopping; add "
            "--early_stopping_patience N"
        )
    if cfg.best_metric.endswith("_ema") and not cfg.model_ema:
        raise UserError(
            f"--best_metric {cfg.best_metric} scores the EMA weights; add --model_ema, or "
            f"choose {cfg.best_metric.removesuffix('_ema')}"
        )
    if cfg.max_time is not None:
        parse_duration(cfg.max_time)


# Units of --max_time's "2h30m" form, in seconds.
DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str, flag: str = "--max_time") -> float:
    """Seconds in "2h30m", "90m", "45s", "1.5h", "3600" (seconds) or Lightning's "DD:HH:MM:SS"
    (also "HH:MM:SS"); one clear error otherwise."""
    spec = text.strip().lower()
    number = r"(\d+(?:\.\d*)?)"
    seconds = None
    if re.fullmatch(number, spec):
        seconds = float(spec)
    elif re.fullmatch(rf"{number}(:{number}){{2,3}}", spec):
        parts = [float(part) for part in spec.split(":")]
        seconds = sum(
            v * unit for v, unit in zip(reversed(parts), (1, 60, 3600, 86400), strict=False)
        )
    elif spec and (match := re.fullmatch("".join(rf"(?:{number}{u})?" for u in "dhms"), spec)):
        seconds = sum(
            float(v) * unit
            for v, unit in zip(match.groups(), DURATION_UNITS.values(), strict=True)
            if v
        )
    if seconds is None or seconds <= 0:
        raise UserError(
            f"{flag} {text!r}: give a positive duration such as 2h30m, 90m, 45s, 3600 "
            "(seconds) or DD:HH:MM:SS"
        )
    return seconds


def optimizer_batch(cfg: TrainConfig) -> int:
    """Images per optimizer step in each process: --accum_steps loader batches of --batch_size.
    The training loader yields them as one batch, so sample order and resuming do not depend on
    how a step is split into forward/backward passes."""
    return cfg.batch_size * cfg.accum_steps


def effective_batch(cfg: TrainConfig, world_size: int) -> int:
    """Images per optimizer step over all processes: batch_size x accum_steps x world size."""
    return optimizer_batch(cfg) * world_size


def effective_batch_line(cfg: TrainConfig, world_size: int) -> str:
    return (
        f"Effective batch: {cfg.batch_size} x {cfg.accum_steps} step(s) x {world_size} "
        f"process(es) = {effective_batch(cfg, world_size)} images per optimizer step"
    )


def preset_summary(cfg: TrainConfig, switch: str) -> str:
    """What a preset chose, and which of its values explicit flags replaced, as one line."""
    preset = PRESETS[switch]
    chosen = [f"{k}={v}" for k, v in preset.items() if getattr(cfg, k) == v]
    kept = [f"{k}={getattr(cfg, k)}" for k, v in preset.items() if getattr(cfg, k) != v]
    return f"--{switch} chose: {', '.join(chosen) or 'nothing'}" + (
        f"; your flags kept: {', '.join(kept)}" if kept else ""
    )

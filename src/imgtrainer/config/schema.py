"""The knobs: every training flag as one field of ``TrainConfig``, and the presets.

A field's metadata holds its help group, text, bounds and resume rule; everything else about a
flag (its ``--help`` group, bounds check, resume check) derives from them. The launcher's flags
are in ``launcher_flags``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from imgtrainer import redact
from imgtrainer.config.bounds import (
    AT_LEAST_1,
    BETA_ALPHA,
    OFF_OR_MORE,
    OFF_OR_POSITIVE,
    POSITIVE,
    PROBABILITY,
    ZERO_OR_MORE,
    Bound,
    interval,
)
from imgtrainer.errors import UserError

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


# ----------------------------------------------------------------------------- the trainer's flags


# A flag whose new value a resume refuses without --resume_override (``SCHEDULE_FLAGS``).
RESUME_CHECKED = "resume_checked"


@dataclass(frozen=True)
class _Flag:
    """A flag of TrainConfig before its help: its ``--help`` group, default, ``choices`` and
    rules: the field's own bounds (a Bound, checked by ``validate``) and RESUME_CHECKED."""

    group: str
    default: Any
    rules: tuple[Bound | str, ...]
    choices: list[str] | None

    def help(self, text: str, alias: str | None = None) -> Any:
        """The dataclass field, its flag in its metadata (``alias``: another name, shown first)."""
        bounds = next((rule for rule in self.rules if isinstance(rule, Bound)), None)
        meta = {"group": self.group, "help": text, "bounds": bounds, "choices": self.choices}
        meta["alias"] = alias
        resume_checked = RESUME_CHECKED in self.rules
        return field(default=self.default, metadata={**meta, "resume_checked": resume_checked})


def _opt(group: str, default: Any, *rules: Bound | str, choices: list[str] | None = None) -> _Flag:
    return _Flag(group, default, rules, choices)


# One field maker per --help group; the groups are listed in the order of their first field.
_data = functools.partial(_opt, "data")
_augment = functools.partial(_opt, "augmentation")
_model = functools.partial(_opt, "model")
_optim = functools.partial(_opt, "optimisation")
_imbalance = functools.partial(_opt, "class imbalance")
_memory = functools.partial(_opt, "precision and memory")
_dist = functools.partial(_opt, "distributed")
_logging = functools.partial(_opt, "checkpoints and logging")
_stopping = functools.partial(_opt, "validation, stopping and checkpoint history")


# The longer helps of the data flags (the class holds every flag on a few screens).
TRAIN_DATA_HELP = (
    "training data: a folder <dir>/<class>/<image>, a .csv/.tsv list (path,label), Parquet (a file "
    "or a folder) or tar shards (train-{000000..000099}.tar or a glob); lists, Parquet and shards "
    "also in object storage (s3://bucket/train-{000000..000099}.tar)"
)
IMAGE_COLUMN_HELP = "the column holding the image: Parquet (default image or img), a list (path)"
LABEL_COLUMN_HELP = (
    "the column holding the label: Parquet (default label or labels), a list (label); for tar "
    "shards, the field of a key.json member (default label)"
)
STORAGE_OPTIONS_HELP = (
    "JSON object of options for the object store of s3:// (gs://, az://) data and checkpoints, "
    "passed to its fsspec filesystem; credentials in it (key, secret, token, ...) are written "
    "nowhere, shown as <redacted>; the endpoint may also come from AWS_ENDPOINT_URL"
)
REMOTE_CACHE_HELP = (
    "bytes read from object storage are kept on the local disk in <log_dir>/remote_cache, up to "
    "this many GB (0: none), so later epochs and the image check read them there"
)


@dataclass(frozen=True)
class InputFlags:
    """The flags of what a step sees: the data, how it is read, and its augmentation (the first
    of ``TrainConfig``'s fields, in ``--help`` order)."""

    train_dir: str = _data("data/train").help(TRAIN_DATA_HELP, "train_data")
    val_dir: str = _data("data/val").help("validation data with the same classes", "val_data")
    class_names: str | None = _data(None).help(
        "file of class names, one a line, for labels given as class indices (lists, Parquet, shards)"
    )
    image_column: str = _data("").help(IMAGE_COLUMN_HELP)
    label_column: str = _data("").help(LABEL_COLUMN_HELP)
    storage_options: str = _data("").help(STORAGE_OPTIONS_HELP)
    remote_cache_gb: float = _data(10.0, ZERO_OR_MORE).help(REMOTE_CACHE_HELP)
    demo: bool = _data(False).help("write the bundled digits demo data to data/demo, train on it")
    image_size: int = _data(224, POSITIVE).help(
        "side of the square crop fed to the model, in pixels"
    )
    eval_resize_ratio: float = _data(
        0.875, interval("(0, 1]", "the crop's share of the resized image's short side")
    ).help(
        "validation: resize the short side to image_size / R, then centre-crop image_size (timm's "
        "crop_pct; 1.0: no margin cropped); stored in the checkpoint for evaluate.py / predict.py"
    )
    num_workers: int | None = _data(None, ZERO_OR_MORE).help(
        "loader worker processes per training process (default: from the CPU cores per process and "
        "the image source: more for files than for RAM, at most 4 for the GPU cache)"
    )
    cache_images: str = _data("auto", choices=["auto", "none", "ram", "gpu"]).help(
        "decode every image once and keep it in memory: ram, gpu (on the device), none (read the "
        "files every epoch), or auto (gpu when it fits in a quarter of the free device memory, "
        "else ram when it fits in a quarter of the free memory)"
    )
    prefetch_factor: int = _data(2, AT_LEAST_1).help("batches each loader worker prepares ahead")
    audit_data_every: int = _data(100, OFF_OR_MORE).help(
        "check an image of the first batches, then of every N-th, against the CPU path; 0: off"
    )
    shuffle_window: int | None = _data(None, POSITIVE, RESUME_CHECKED).help(
        "with --sampler window: shards (Parquet row groups; for a folder or list, groups of 256 "
        "images) whose images are mixed at any time (default 16, or all when fewer)"
    )
    crop_scale_min: float = _augment(0.08, interval("(0, 1]")).help(
        "smallest area fraction kept by RandomResizedCrop"
    )
    hflip: float = _augment(0.5, PROBABILITY).help("probability of a horizontal flip in training")
    auto_augment: str = _augment("none", choices=["none", "trivialaugment", "randaugment"]).help(
        "per-image policy after the crop and flip: trivialaugment (TrivialAugmentWide), "
        "randaugment (RandAugment, 2 ops at magnitude 9) or none"
    )
    random_erasing: float = _augment(0.0, PROBABILITY).help(
        "probability of erasing a random rectangle of each training image (filled with the mean "
        "colour: 0 after normalization)"
    )
    mixup: float = _augment(0.0, BETA_ALPHA, RESUME_CHECKED).help(
        "mixup alpha: blend image pairs with Beta(alpha, alpha) (0: off)"
    )
    cutmix: float = _augment(0.0, BETA_ALPHA, RESUME_CHECKED).help(
        "cutmix alpha: paste a box of the paired image (0: off)"
    )
    mix_switch_prob: float = _augment(0.5, PROBABILITY, RESUME_CHECKED).help(
        "with both --mixup and --cutmix, the probability that a batch uses cutmix"
    )
    mix_off_epochs: int = _augment(0, ZERO_OR_MORE, RESUME_CHECKED).help(
        "turn mixup/cutmix off for the last N epochs"
    )


@dataclass(frozen=True)
class TrainConfig(InputFlags):
    """Every training flag, in ``--help`` order; HELP_GROUPS and the bounds come from the fields."""

    model: str = _model("resnet18").help("any timm model name")
    pretrained: bool = _model(False).help(
        "start from timm's pretrained weights (needs network access)"
    )
    pretrained_path: str | None = _model(None).help(
        "local timm/torchvision state dict to start from (the classifier head is replaced)"
    )
    compile: bool = _model(False).help(
        "compile the model with torch.compile (slow first steps, faster after)"
    )
    model_ema: bool = _model(False).help(
        "keep an exponential moving average (EMA) of the weights and BatchNorm statistics, updated "
        "after every optimizer step taken; evaluated next to the weights every epoch "
        "(val_acc_ema, ...) and saved as model_ema_state_dict"
    )
    ema_decay: float = _model(0.999, interval("(0, 1)"), RESUME_CHECKED).help(
        "the EMA's decay per optimizer step, after a warm-up: update n uses min(ema_decay, 1 - "
        "n^-0.75), so 0.999 is reached after 10,000 steps"
    )
    epochs: int = _optim(50, POSITIVE).help("number of epochs")
    batch_size: int = _optim(32, POSITIVE).help(
        "images per forward/backward pass in each process; a step takes --accum_steps of them"
    )
    accum_steps: int = _optim(1, AT_LEAST_1).help(
        "gradient accumulation: batches of --batch_size per optimizer step in each process "
        "(gradients exchanged once per step); effective batch = batch_size x accum_steps x processes"
    )
    global_batch_size: int | None = _optim(None, POSITIVE).help(
        "images per optimizer step over all processes, kept when a resume or an elastic restart "
        "runs on another number of processes: --accum_steps (and where it must --batch_size, as "
        "the largest pass that divides a process's share) are chosen to make it (default: "
        "batch_size x accum_steps x processes of the run's first start)"
    )
    learning_rate: float = _optim(0.001, POSITIVE, RESUME_CHECKED).help(
        "peak learning rate (before --lr_scaling)"
    )
    weight_decay: float = _optim(0.01, RESUME_CHECKED).help("weight decay")
    optimizer: str = _optim("adamw", choices=["adamw", "sgd"]).help("optimizer")
    momentum: float = _optim(0.9, RESUME_CHECKED).help("momentum for sgd")
    scheduler: str = _optim("cosine", RESUME_CHECKED, choices=["cosine", "step", "none"]).help(
        "learning-rate schedule, stepped every optimizer step"
    )
    warmup_epochs: float = _optim(0.0, RESUME_CHECKED).help(
        "linear warm-up length in epochs (fractions allowed)"
    )
    step_size: int = _optim(30, RESUME_CHECKED).help("epochs between decays for --scheduler step")
    gamma: float = _optim(0.1, RESUME_CHECKED).help("decay factor for --scheduler step")
    lr_scaling: str = _optim("none", RESUME_CHECKED, choices=["none", "linear", "sqrt"]).help(
        "scale the learning rate by the effective batch's ratio to --batch_size, R = accum_steps x "
        "processes: linear (lr*R) or sqrt (lr*sqrt(R))"
    )
    label_smoothing: float = _optim(0.0, interval("[0, 1)"), RESUME_CHECKED).help(
        "label smoothing of the training loss"
    )
    decay_norm_and_bias: bool = _optim(False, RESUME_CHECKED).help(
        "weight decay on every parameter; by default normalisation weights and biases (every 1-D "
        "parameter, timm's filter) get none"
    )
    clip_grad_norm: float = _optim(0.0, OFF_OR_POSITIVE, RESUME_CHECKED).help(
        "clip the gradient's total L2 norm to this before each optimizer step (0: off); unscaled "
        "first under AMP, once per step across micro-batches"
    )
    head_lr_scale: float = _optim(1.0, POSITIVE, RESUME_CHECKED).help(
        "the classifier head's learning rate is K times the rest's (fine-tuning)"
    )
    freeze_backbone_epochs: int = _optim(0, RESUME_CHECKED).help(
        "train only the classifier head for the first N epochs (the backbone's learning rate is 0; "
        "its BatchNorm statistics still adapt), then every layer"
    )
    class_weights: str = _imbalance("none", RESUME_CHECKED, choices=["none", "balanced"]).help(
        "weight each class in the training loss: balanced: n_images / (n_classes x the class's "
        "images), scikit-learn's formula; none: every image counts the same"
    )
    sampler: str = _imbalance(
        "random", RESUME_CHECKED, choices=["random", "balanced", "window"]
    ).help(
        "training order: random (each image once per epoch, shuffled), balanced (an epoch of the "
        "same length drawing every class equally often: small classes' images repeat, large "
        "classes' are subsampled) or window (each image once per epoch, shuffled within a window "
        "of --shuffle_window shards read whole; the default for training data in object storage)"
    )
    use_amp: bool = _memory(False).help(
        "automatic mixed precision (float16 + GradScaler on CUDA; bfloat16 on the CPU, usually "
        "slower there)"
    )
    amp_dtype: str = _memory("float16", choices=["float16", "bfloat16"]).help(
        "autocast dtype on CUDA"
    )
    channels_last: bool = _memory(True).help(
        "channels_last memory format on CUDA (faster tensor-core convolutions; ignored on the CPU; "
        "--no_channels_last: off)"
    )
    low_memory: bool = _memory(False).help(
        "preset for small GPUs (2 GB): --use_amp --channels_last --grad_checkpointing (of the "
        "early, high-resolution layers only) --auto_micro_batch --prefetch_factor 1; on the CPU it "
        "trains in float32. Flags given explicitly win"
    )
    auto_micro_batch: bool = _memory(False).help(
        "before training, find the largest micro-batch (from --batch_size, halving) that fits in "
        "--max_memory_gb; on out-of-memory during training, halve it and redo the step"
    )
    max_memory_gb: float | None = _memory(None, POSITIVE).help(
        "memory budget per process for --auto_micro_batch, in GiB (default and most: the device's "
        "memory divided by the processes using it)"
    )
    grad_checkpointing: bool = _memory(False).help(
        "activation checkpointing where timm supports it: recompute activations in backward "
        "instead of keeping them (less memory, slower steps)"
    )
    device: str = _dist("auto", choices=DEVICE_CHOICES).help(
        "auto: CUDA when visible, else the CPU"
    )
    sync_bn: bool = _dist(False).help("convert BatchNorm to SyncBatchNorm across processes")
    dist_timeout_minutes: float = _dist(30.0, POSITIVE).help(
        "process-group timeout: a hung rank fails the job after this long"
    )
    hang_timeout: str = _dist("5m").help(
        "launch_ddp.py names a rank or loader worker stuck this long (5m, 45s; 0: off), its stacks "
        "in <log_dir>/hang/, and restarts the workers (--max_restarts), else exits with code 3"
    )
    check_sync: bool = _dist(False).help(
        "after every epoch, verify that all ranks hold identical parameters and buffers"
    )
    checkpoint_dir: str = _logging("checkpoints").help("where checkpoint_*.pth go")
    log_dir: str = _logging("logs").help("where training_history.json and per-rank logs go")
    log_interval: int = _logging(20, POSITIVE).help(
        "steps between progress-bar metric updates, or plain lines where the console is not a "
        "terminal; their metrics are copied from the GPU without waiting and shown at the next "
        "one (or the epoch's end), so the console lags one interval; the epoch's line is exact"
    )
    resume: str | None = _logging(None).help(
        "continue from this checkpoint, or 'auto': the newest one in --checkpoint_dir if any, else "
        "start fresh"
    )
    resume_override: bool = _logging(False).help(
        "when resuming, apply flags that change the schedule or the optimisation (learning rate, "
        "scheduler, warm-up, weight decay and its grouping, momentum, label smoothing, "
        "mixup/cutmix, gradient clipping, head learning rate, frozen epochs, batch per step, class "
        "weights, sampler) instead of refusing them"
    )
    overwrite: bool = _logging(False).help(
        "start a new run in a --checkpoint_dir / --log_dir that hold an earlier run's results, "
        "replacing its checkpoints and training_history.json (at this run's first checkpoint); "
        "without it such a start is refused"
    )
    save_every_steps: int = _logging(0, ZERO_OR_MORE).help(
        "also write checkpoint_latest.pth every N steps inside an epoch (0: only at epoch end)"
    )
    save_every_minutes: float = _logging(10.0, OFF_OR_POSITIVE).help(
        "also write checkpoint_latest.pth mid-epoch N minutes after the last checkpoint (0: off)"
    )
    tensorboard: bool = _logging(True).help(
        "write TensorBoard event files (curves, hyper-parameters, a grid of augmented images) to "
        "<log_dir>/tensorboard on the main process; --no_tensorboard: off"
    )
    log_to: str = _logging("none").help(
        "also send the curves to these experiment trackers, comma-separated: wandb, mlflow (main "
        "process; each needs its package, and its login unless offline: WANDB_MODE=offline, "
        "MLflow's local store); <log_dir>/metrics.csv is always written"
    )
    seed: int = _logging(42).help("seed of sample order, augmentation and initial weights")
    deterministic: bool = _logging(False).help(
        "deterministic algorithms: bitwise-reproducible runs and resumes (slower on CUDA)"
    )
    val_every_epochs: int = _stopping(1, AT_LEAST_1).help(
        "validate every N epochs (the last epoch always); only validated epochs count as best"
    )
    best_metric: str = _stopping("val_acc", choices=list(BEST_METRICS)).help(
        "the validation metric that picks checkpoint_best.pth and drives early stopping (val_loss: "
        "lower is better); with --model_ema, val_acc/val_loss/val_top5 take the better of the raw "
        "and EMA weights, the *_ema ones the EMA weights alone"
    )
    early_stopping_patience: int = _stopping(0, OFF_OR_MORE).help(
        "stop when --best_metric has not improved for N validated epochs in a row (0: off); exit "
        "code 0, the summary says so"
    )
    early_stopping_min_delta: float = _stopping(0.0, ZERO_OR_MORE).help(
        "with --early_stopping_patience: a change of --best_metric smaller than this is no "
        "improvement"
    )
    keep_checkpoints: int = _stopping(0, OFF_OR_MORE).help(
        "also keep the K best epochs' checkpoints by --best_metric as checkpoint_epoch_NNN.pth "
        "(hard links where possible; 0: only latest and best)"
    )
    save_every_epochs: int = _stopping(0, OFF_OR_MORE).help(
        "also keep checkpoint_epoch_NNN.pth of every Nth epoch, whatever its score (0: off)"
    )
    max_time: str | None = _stopping(None).help(
        "time budget of this run, e.g. 2h30m, 90m, 45s, 3600 (seconds) or DD:HH:MM:SS: stop with a "
        "checkpoint and the resume command while one still fits; exit code 0"
    )

    def to_dict(self) -> dict[str, Any]:
        return written_values(self)


def written_values(cfg: TrainConfig) -> dict[str, Any]:
    """The flags as plain values, as every file and line of the run holds them: credentials
    (``--storage_options``' keys, a URL's user and password) replaced (``redact``)."""
    values = dataclasses.asdict(cfg)
    values["storage_options"] = redact.options_text(cfg.storage_options)
    return {k: redact.text(v) if isinstance(v, str) else v for k, v in values.items()}


TRAIN_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _help_groups() -> dict[str, tuple[str, ...]]:
    groups: dict[str, list[str]] = {}
    for f in TRAIN_FIELDS.values():
        groups.setdefault(f.metadata["group"], []).append(f.name)
    return {title: tuple(names) for title, names in groups.items()}


# How ``--help`` groups the flags (each field's group), in the order of the fields.
HELP_GROUPS: dict[str, tuple[str, ...]] = _help_groups()

# Flags that change what the optimisation does: a resume refuses new values of them unless
# --resume_override (``checkpoints.resume.SCHEDULE_FLAGS``).
RESUME_CHECKED_FLAGS: tuple[str, ...] = tuple(
    f.name for f in TRAIN_FIELDS.values() if f.metadata["resume_checked"]
)

# The single-field bounds of the flags that have one; ``validate`` checks them all.
BOUNDS: dict[str, Bound] = {
    f.name: f.metadata["bounds"] for f in TRAIN_FIELDS.values() if f.metadata["bounds"]
}


# ----------------------------------------------------------------------------- presets


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


# What a 2 GB GPU needs, keeping the batch size. Explicit flags win (``--no_<flag>`` turns a
# switch off). ``use_amp`` and ``channels_last`` do nothing on the CPU under this preset
# (bfloat16 autocast is much slower there; the micro-batches already bound the memory).
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
    | {f.name for f in TRAIN_FIELDS.values() if f.default is True}
)


def preset_summary(cfg: TrainConfig, switch: str) -> str:
    """What a preset chose, and which of its values explicit flags replaced, as one line."""
    preset = PRESETS[switch]
    chosen = [f"{k}={v}" for k, v in preset.items() if getattr(cfg, k) == v]
    kept = [f"{k}={getattr(cfg, k)}" for k, v in preset.items() if getattr(cfg, k) != v]
    return f"--{switch} chose: {', '.join(chosen) or 'nothing'}" + (
        f"; your flags kept: {', '.join(kept)}" if kept else ""
    )

"""From flags to a checked TrainConfig: parsers, run files, the merge, validation.

The argparse parsers generated from the fields, YAML run files, the merge of defaults, presets,
run file and command line, validation, durations, and the resolved configuration written back
as a run file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from imgtrainer import redact
from imgtrainer.config.launcher_flags import LAUNCHER_FIELDS
from imgtrainer.config.layout import with_global_batch_layout
from imgtrainer.config.schema import (
    BOUNDS,
    HELP_GROUPS,
    NEGATABLE,
    PRESETS,
    TRAIN_FIELDS,
    TrainConfig,
    tracker_names,
)
from imgtrainer.errors import UserError, message_line
from imgtrainer.process import TorchrunEnv
from imgtrainer.storage import is_url
from imgtrainer.storage.remote import parse_options

# ----------------------------------------------------------------------------- parsers


def value_types(f: dataclasses.Field) -> tuple[type, ...]:
    """The types a field's annotation names, None left out: ``int | str | None`` is (int, str)."""
    kinds = {"int": int, "float": float, "str": str, "bool": bool}
    return tuple(kinds[name] for name in str(f.type).split(" | ") if name != "None")


# The launcher's flags that a run file may hold, with the YAML types each accepts (``device`` is
# a trainer flag, checked as such).
LAUNCHER_KEYS: dict[str, tuple[type, ...]] = {
    name: value_types(f)
    for name, f in LAUNCHER_FIELDS.items()
    if f.metadata.get("run_file", True) and not f.metadata.get("trainer")
}


def check_bound(flag: str, value: float | None) -> None:
    """``--flag``'s bound, declared on its field of TrainConfig or LauncherConfig."""
    f = TRAIN_FIELDS.get(flag) or LAUNCHER_FIELDS[flag]
    f.metadata["bounds"].check(flag, value)


def build_parser() -> argparse.ArgumentParser:
    """One ``--flag`` per field, in HELP_GROUPS's groups; every default is SUPPRESS so we can
    tell what the user typed."""
    parser = argparse.ArgumentParser(
        prog="train_ddp.py",
        description="Train an image classifier on images in any data layout (class folders, a "
        "list, Parquet, tar shards), on 1..N processes.",
        argument_default=argparse.SUPPRESS,
    )
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
            _add_flag(group, TRAIN_FIELDS[name])
    return parser


def _add_flag(group: argparse._ActionsContainer, f: dataclasses.Field, **defaults: Any) -> None:
    help_text = f"{f.metadata['help']} (default: {f.default})"
    flag = f"--{f.name}"
    if f.metadata.get("alias"):  # the alias first: the name --help and the docs lead with
        group.add_argument(
            f"--{f.metadata['alias']}",
            flag,
            dest=f.name,
            type=_field_type(f),
            help=help_text,
            **defaults,
        )
        return
    if f.type in ("bool", bool):
        group.add_argument(flag, action="store_true", help=help_text, **defaults)
        if f.name in NEGATABLE:
            group.add_argument(
                f"--no_{f.name}",
                dest=f.name,
                action="store_false",
                help=f"turn --{f.name} off (a preset may turn it on)",
            )
    else:
        choices = f.metadata["choices"]
        kwargs = {"choices": choices} if choices else {}
        group.add_argument(flag, type=_field_type(f), help=help_text, **kwargs, **defaults)


def _field_type(f: dataclasses.Field) -> type:
    return value_types(f)[0]


def add_trainer_flag(parser: argparse._ActionsContainer, name: str) -> None:
    """A trainer flag as TrainConfig declares it, with its default, for another tool's parser."""
    _add_flag(parser, TRAIN_FIELDS[name], default=TRAIN_FIELDS[name].default)


def add_device_argument(parser: argparse._ActionsContainer) -> None:
    """--device of the launcher and of the inference tools: the trainer's."""
    add_trainer_flag(parser, "device")


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per field of LauncherConfig, with its default."""
    for name, f in LAUNCHER_FIELDS.items():
        if f.metadata.get("trainer"):
            add_trainer_flag(parser, name)
            continue
        kinds = value_types(f)
        if kinds == (bool,):
            parser.add_argument(f"--{name}", action="store_true", help=f.metadata["help"])
            continue
        parser.add_argument(
            f"--{name}",
            type=str if str in kinds else kinds[0],
            default=f.default,
            help=f.metadata["help"],
            **({"choices": f.metadata["choices"]} if f.metadata.get("choices") else {}),
        )


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


def print_config_requested(argv: Sequence[str] | None) -> bool:
    return run_file_parser().parse_known_args(argv)[0].print_config


# ----------------------------------------------------------------------------- run files


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
            f"--config {path}: not a readable YAML file ({message_line(str(err))})"
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
    return {
        FLAG_ALIASES.get(str(key), str(key)): _file_value(path, str(key), value)
        for key, value in data.items()
    }


def _file_value(path: Path, key: str, value: Any) -> Any:
    """One key of a run file: a launcher flag of its types, a trainer flag, or an error."""
    if key in LAUNCHER_KEYS:
        expected = LAUNCHER_KEYS[key]
        if not isinstance(value, expected) or isinstance(value, bool):
            raise UserError(
                f"--config {path}: {key} must be "
                f"{' or '.join(t.__name__ for t in expected)}, got {value!r}"
            )
        return value
    if key in TRAIN_FIELDS:
        return _checked_file_value(path, TRAIN_FIELDS[key], value)
    if key in FLAG_ALIASES:
        return _checked_file_value(path, TRAIN_FIELDS[FLAG_ALIASES[key]], value)
    close = difflib.get_close_matches(key.replace("-", "_"), [*TRAIN_FIELDS, *LAUNCHER_KEYS], n=1)
    raise UserError(
        f"--config {path}: unknown key '{key}'"
        + (
            f" (did you mean '{close[0]}'?)"
            if close
            else "; keys are the flag names without '--', see --help"
        )
    )


# Other names of trainer flags (a run file may use either): --train_data for train_dir.
FLAG_ALIASES = {
    f.metadata["alias"]: name for name, f in TRAIN_FIELDS.items() if f.metadata.get("alias")
}


# Flags holding a duration (parse_duration): a run file's number is their seconds.
DURATION_FIELDS = frozenset({"max_time", "hang_timeout"})


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_kind(value: Any, kind: type) -> bool:
    """YAML reads 3 as an int: accept it for a float, but never a bool for a number."""
    if kind is float:
        return _is_number(value)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _checked_file_value(path: Path, f: dataclasses.Field, value: Any) -> Any:
    """``value`` as the field's type (YAML's 3 becomes 3.0 for a float flag), or one error."""
    optional = "None" in str(f.type)
    if value is None and optional:
        return None
    if f.name in DURATION_FIELDS and _is_number(value):
        # Seconds, as on the command line (colon forms stay text: _run_file_loader).
        value = str(value)
    kind = value_types(f)[0]
    if not _is_kind(value, kind):
        raise UserError(
            f"--config {path}: {f.name} must be {kind.__name__}"
            f"{' or null' if optional else ''}, got {value!r}"
        )
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise UserError(
            f"--config {path}: {f.name} must be one of {', '.join(choices)}, got {value!r}"
        )
    return float(value) if kind is float else value


# ----------------------------------------------------------------------------- the merge


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
    if "sampler" not in chosen and is_url(values.get("train_dir", "")):
        values["sampler"] = "window"  # shards read whole from a bucket (docs/usage.md)
    cfg = TrainConfig(**values)
    validate(cfg)
    return with_global_batch_layout(cfg, set(explicit), env or TorchrunEnv.read())


# The launcher hands its resolved flags to the workers here (JSON), so the configuration a run
# writes repeats the launcher's part too.
LAUNCHER_FLAGS_ENV = "TRAIN_DDP_LAUNCHER_FLAGS"


def launcher_flags_from_env() -> dict[str, Any]:
    return json.loads(os.environ.get(LAUNCHER_FLAGS_ENV, "{}"))


def config_yaml(cfg: TrainConfig, launcher: dict[str, Any] | None = None) -> str:
    """The resolved configuration as a run file: ``--config`` of this text repeats the run."""
    import yaml

    header = "# Resolved configuration; rerun with: python launch_ddp.py --config <this file>\n"
    return header + yaml.safe_dump({**(launcher or {}), **cfg.to_dict()}, sort_keys=False)


# ----------------------------------------------------------------------------- validation


def validate(cfg: TrainConfig) -> None:
    """Reject impossible values and combinations with one clear line: first each field's own
    bounds (declared on the field), then the rules between fields."""
    for name, bound in BOUNDS.items():
        bound.check(name, getattr(cfg, name))
    for name in ("warmup_epochs", "freeze_backbone_epochs"):
        if not 0 <= getattr(cfg, name) <= cfg.epochs:
            raise UserError(
                f"--{name} must be between 0 and --epochs ({cfg.epochs}), got {getattr(cfg, name)}"
            )
    if cfg.max_memory_gb is not None and not cfg.auto_micro_batch:
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
    if cfg.shuffle_window is not None and cfg.sampler != "window":
        raise UserError("--shuffle_window is a setting of --sampler window; add --sampler window")
    tracker_names(cfg.log_to)
    keep_credentials_in_memory(cfg)
    if cfg.pretrained and cfg.pretrained_path:
        raise UserError("give either --pretrained (download) or --pretrained_path FILE, not both")
    validate_stopping(cfg)


def keep_credentials_in_memory(cfg: TrainConfig) -> None:
    """--storage_options checked (a JSON object, with or without a URL to use it), and every
    credential this run was given remembered, so that no line or file shows it (``redact``)."""
    options = parse_options(cfg.storage_options)
    urls = [cfg.train_dir, cfg.val_dir, cfg.checkpoint_dir, cfg.log_dir]
    urls += [os.environ.get(name, "") for name in ("AWS_ENDPOINT_URL", "MLFLOW_TRACKING_URI")]
    redact.remember(redact.secrets_of([options, *urls]))


def validate_stopping(cfg: TrainConfig) -> None:
    """The rules between the flags of validation, best checkpoint and early stopping."""
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
    hang_seconds(cfg.hang_timeout)


def hang_seconds(text: str) -> float | None:
    """--hang_timeout in seconds; None when it is off ("0" or "off")."""
    if text.strip().lower() in ("0", "off", "0s"):
        return None
    return parse_duration(text, "--hang_timeout")


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

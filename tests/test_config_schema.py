"""TrainConfig is the only table of knobs: each field's help group, bounds and resume rule live
in its metadata, and --help's groups, validate's bounds, the resume check, the inference tools'
bounds and the launcher's run-file keys are derived from the fields."""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from imgtrainer.checkpoints.resume import SCHEDULE_FLAGS
from imgtrainer.config import (
    HELP_GROUPS,
    LAUNCHER_KEYS,
    LauncherConfig,
    TrainConfig,
    parse_config,
)
from imgtrainer.config.bounds import interval
from imgtrainer.errors import UserError

# The lines validate wrote by hand before the bounds moved onto the fields: kept word for word.
BOUND_LINES = [
    (["--epochs", "0"], "--epochs must be positive, got 0"),
    (["--learning_rate", "-0.1"], "--learning_rate must be positive, got -0.1"),
    (["--dist_timeout_minutes", "0"], "--dist_timeout_minutes must be positive, got 0.0"),
    (["--num_workers", "-1"], "--num_workers must be 0 or more, got -1"),
    (["--save_every_steps", "-1"], "--save_every_steps must be 0 or more, got -1"),
    (["--save_every_minutes", "-1"], "--save_every_minutes must be 0 (off) or positive, got -1.0"),
    (["--label_smoothing", "1"], "--label_smoothing must be in [0, 1), got 1.0"),
    (
        ["--eval_resize_ratio", "1.5"],
        "--eval_resize_ratio must be in (0, 1] (the crop's share of the resized image's short "
        "side), got 1.5",
    ),
    (["--clip_grad_norm", "-1"], "--clip_grad_norm must be 0 (off) or positive, got -1.0"),
    (["--head_lr_scale", "0"], "--head_lr_scale must be positive, got 0.0"),
    (["--ema_decay", "1"], "--ema_decay must be in (0, 1), got 1.0"),
    (["--crop_scale_min", "0"], "--crop_scale_min must be in (0, 1], got 0.0"),
    (["--hflip", "2"], "--hflip is a probability in [0, 1], got 2.0"),
    (["--cutmix", "-1"], "--cutmix is a Beta alpha: 0 (off) or positive, got -1.0"),
    (["--prefetch_factor", "0"], "--prefetch_factor must be at least 1, got 0"),
    (["--global_batch_size", "0"], "--global_batch_size must be positive, got 0"),
    (
        ["--max_memory_gb", "0", "--auto_micro_batch"],
        "--max_memory_gb must be positive, got 0.0",
    ),
    (["--keep_checkpoints", "-1"], "--keep_checkpoints must be 0 (off) or more, got -1"),
    (["--val_every_epochs", "0"], "--val_every_epochs must be at least 1, got 0"),
    (
        ["--early_stopping_min_delta", "-1"],
        "--early_stopping_min_delta must be 0 or more, got -1.0",
    ),
]


@pytest.mark.parametrize("flags, line", BOUND_LINES)
def test_a_fields_bound_refuses_a_bad_value_with_the_same_line(flags: list[str], line: str):
    with pytest.raises(UserError) as err:
        parse_config(flags)
    assert str(err.value) == line


def test_the_rules_between_fields_stay_after_the_bounds():
    with pytest.raises(UserError, match="--warmup_epochs must be between 0 and --epochs"):
        parse_config(["--warmup_epochs", "3", "--epochs", "2"])
    with pytest.raises(UserError, match="--epochs must be positive"):  # the bound comes first
        parse_config(["--warmup_epochs", "3", "--epochs", "0"])


def test_the_inference_tools_use_the_training_flags_bounds():
    from imgtrainer.tools.inference import check_inference_arguments

    def refusal(**values) -> str:
        fine = {"batch_size": 8, "num_workers": None, "eval_resize_ratio": None}
        args = argparse.Namespace(**fine | values)
        with pytest.raises(UserError) as err:
            check_inference_arguments(args)
        return str(err.value)

    trainer_line = {tuple(flags): line for flags, line in BOUND_LINES}
    assert refusal(eval_resize_ratio=1.5) == trainer_line["--eval_resize_ratio", "1.5"]
    assert refusal(batch_size=0) == "--batch_size must be positive, got 0"
    assert refusal(num_workers=-1) == "--num_workers must be 0 or more, got -1"
    check_inference_arguments(argparse.Namespace(batch_size=8, num_workers=0, eval_resize_ratio=1))


def test_an_interval_reads_as_written():
    half_open = interval("(0, 1]")
    assert [half_open.allows(v) for v in (0, 0.5, 1, 1.5)] == [False, True, True, False]
    closed_open = interval("[0, 1)")
    assert [closed_open.allows(v) for v in (0, 1)] == [True, False]


def test_help_groups_cover_every_field_exactly_once():
    fields = dataclasses.fields(TrainConfig)
    grouped = Counter(name for names in HELP_GROUPS.values() for name in names)
    assert grouped == Counter(f.name for f in fields)
    for f in fields:
        assert f.name in HELP_GROUPS[f.metadata["group"]]
    # The groups are listed in the order of their first field.
    firsts = [names[0] for names in HELP_GROUPS.values()]
    order = [f.name for f in fields]
    assert firsts == sorted(firsts, key=order.index)


def test_the_resume_check_covers_the_flags_it_always_did():
    assert set(SCHEDULE_FLAGS) == {
        *("learning_rate", "lr_scaling", "scheduler", "warmup_epochs", "step_size", "gamma"),
        *("weight_decay", "momentum", "label_smoothing", "decay_norm_and_bias"),
        *("clip_grad_norm", "head_lr_scale", "freeze_backbone_epochs", "ema_decay"),
        *("mixup", "cutmix", "mix_switch_prob", "mix_off_epochs", "class_weights", "sampler"),
        "shuffle_window",
    }


def test_distributed_is_no_flag_any_more():
    assert "distributed" not in {f.name for f in dataclasses.fields(TrainConfig)}
    with pytest.raises(SystemExit):
        parse_config(["--distributed"])


# ----------------------------------------------------------------------------- the launcher


def test_launcher_flags_come_from_launcher_config():
    from imgtrainer.run.launcher import build_parser

    fields = [f.name for f in dataclasses.fields(LauncherConfig)]
    parsed = [a.dest for a in build_parser()._actions if a.dest != "help"]
    assert parsed == fields
    # A run file may hold each launcher flag but --dry_run; --device is checked as the trainer's.
    assert list(LAUNCHER_KEYS) == [f for f in fields if f not in ("device", "dry_run")]
    defaults = vars(build_parser().parse_args([]))
    assert all(defaults[f.name] == f.default for f in dataclasses.fields(LauncherConfig))


@pytest.mark.parametrize(
    "text, phrase",
    [
        ("master_port: abc\n", "master_port must be int, got 'abc'"),
        ("max_restarts: true\n", "max_restarts must be int, got True"),
        ("num_gpus: [1]\n", "num_gpus must be int or str, got [1]"),
        ("rdzv_id: 7\n", "rdzv_id must be str, got 7"),
        ("device: tpu\n", "device must be one of auto, cuda, cpu, got 'tpu'"),
        ("dry_run: true\n", "unknown key 'dry_run'"),
    ],
)
def test_a_launcher_flag_in_a_run_file_is_type_checked(tmp_path: Path, text: str, phrase: str):
    run = tmp_path / "run.yaml"
    run.write_text(text)
    with pytest.raises(UserError) as err:
        parse_config(["--config", str(run)])
    assert phrase in str(err.value) and str(run) in str(err.value)


def test_launcher_flags_of_their_types_pass(tmp_path: Path):
    run = tmp_path / "run.yaml"
    run.write_text("num_gpus: all\nnnodes: 1:2\nmaster_port: 29501\nnproc: 2\n")
    assert parse_config(["--config", str(run)]) == parse_config([])


def test_nproc_is_refused_by_its_bound():
    from imgtrainer.run.launcher import cpu_processes

    args = argparse.Namespace(device="cpu", num_gpus=None, nproc=0)
    with pytest.raises(UserError, match="^--nproc must be at least 1, got 0$"):
        cpu_processes(args)

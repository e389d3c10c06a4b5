"""YAML run files: --config sets any flag, the command line wins, bad keys and types are one
error naming the key and the file, and the resolved configuration reruns to itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from imgtrainer.config import LAUNCHER_KEYS, config_yaml, parse_config, parse_duration
from imgtrainer.errors import UserError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_file_sets_flags_and_the_command_line_wins(tmp_path: Path):
    run = write(
        tmp_path,
        "epochs: 3\nlearning_rate: 1\nuse_amp: true\nbatch_size: 16\n"
        "nproc: 2\nmax_memory_gb: null\n",
    )
    cfg = parse_config(["--config", str(run), "--epochs", "5"])
    assert (cfg.epochs, cfg.learning_rate, cfg.use_amp, cfg.batch_size) == (5, 1.0, True, 16)
    assert isinstance(cfg.learning_rate, float)


def test_a_preset_switched_on_in_the_file_applies_under_the_files_values(tmp_path: Path):
    cfg = parse_config(["--config", str(write(tmp_path, "demo: true\nepochs: 2\n"))])
    assert cfg.demo and cfg.image_size == 32 and cfg.epochs == 2  # preset, then the file


@pytest.mark.parametrize(
    "text, phrases",
    [
        ("epoch: 3\n", ["unknown key 'epoch'", "did you mean 'epochs'"]),
        ("epochs: three\n", ["epochs must be int", "'three'"]),
        ("use_amp: 1\n", ["use_amp must be bool"]),
        ("batch_size: true\n", ["batch_size must be int"]),
        ("optimizer: adam\n", ["optimizer must be one of adamw, sgd"]),
        ("nproc: two\n", ["nproc must be int"]),
        ("- epochs\n", ["expected a mapping"]),
        ("epochs: [1\n", ["not a readable YAML file"]),
    ],
)
def test_bad_keys_and_types_name_the_key_and_the_file(
    tmp_path: Path, text: str, phrases: list[str]
):
    run = write(tmp_path, text)
    with pytest.raises(UserError) as err:
        parse_config(["--config", str(run)])
    message = str(err.value)
    assert str(run) in message and "\n" not in message
    for phrase in phrases:
        assert phrase in message, message


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("max_time: 1:30:00\n", 5400),  # text, not YAML 1.1's base-60 number
        ("max_time: 2:00:00:00\n", 2 * 86400),  # DD:HH:MM:SS as on the command line
        ("max_time: 90\n", 90),
        ("max_time: 2.5\n", 2.5),
        ("max_time: '1:30:00'\n", 5400),
        ("max_time: 2h30m\n", 9000),
    ],
)
def test_a_yaml_number_for_max_time_is_seconds(tmp_path: Path, text: str, seconds: float):
    cfg = parse_config(["--config", str(write(tmp_path, text))])
    assert parse_duration(cfg.max_time) == seconds
    resolved = write(tmp_path, config_yaml(cfg, {}))
    assert parse_config(["--config", str(resolved)]) == cfg


@pytest.mark.parametrize(
    "text, phrase",
    [
        ("max_time: -5\n", "--max_time '-5': give a positive duration"),
        ("max_time: 0\n", "--max_time '0': give a positive duration"),
        ("max_time: true\n", "max_time must be str or null, got True"),
        ("max_time: 1:30\n", "--max_time '1:30': give a positive duration"),  # as on the CLI
    ],
)
def test_a_yaml_max_time_that_is_no_duration_is_one_error(tmp_path: Path, text: str, phrase):
    with pytest.raises(UserError, match=re.escape(phrase)):
        parse_config(["--config", str(write(tmp_path, text))])


def test_a_missing_file_is_one_error(tmp_path: Path):
    with pytest.raises(UserError, match="no such file"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])


def test_the_resolved_configuration_reruns_to_the_same_configuration(tmp_path: Path):
    cfg = parse_config(
        [
            "--low_memory",
            "--epochs",
            "7",
            "--no_channels_last",
            "--resume",
            "auto",
            "--learning_rate",
            "0.02",
        ]
    )
    resolved = write(tmp_path, config_yaml(cfg, {"nproc": 2}))
    assert parse_config(["--config", str(resolved)]) == cfg
    assert set(LAUNCHER_KEYS) >= {"nproc", "num_gpus", "nnodes", "start_method"}


def test_launcher_bad_key_is_one_line_and_exit_2(tmp_path: Path):
    from conftest import ROOT, assert_user_error, run_cli

    run = write(tmp_path, "epochs: 2\nlerning_rate: 0.1\n")
    result = run_cli([ROOT / "launch_ddp.py", "--config", run], cwd=tmp_path)
    assert_user_error(result, "unknown key 'lerning_rate'", str(run))


@pytest.mark.slow
def test_a_run_from_a_file_writes_the_config_that_repeats_it(tiny_dataset, tmp_path: Path):
    """Through the launcher: the file's launcher key (nproc) and trainer keys are used, the
    command line wins, and <log_dir>/config.yaml resolves to the same configuration."""
    import yaml

    from conftest import ROOT, run_cli

    train, val = tiny_dataset
    run = write(
        tmp_path,
        f"train_dir: {train}\nval_dir: {val}\nimage_size: 16\nbatch_size: 8\n"
        "num_workers: 0\nepochs: 3\nnproc: 2\ndevice: cpu\n"
        "learning_rate: 0.01\nmodel: test_resnet\n",  # timm's small ResNet: a quick epoch
    )
    result = run_cli([ROOT / "launch_ddp.py", "--config", run, "--epochs", "1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "world size 2" in result.stdout
    written = yaml.safe_load((tmp_path / "logs" / "config.yaml").read_text())
    assert written["epochs"] == 1 and written["nproc"] == 2 and written["learning_rate"] == 0.01
    printed = [
        run_cli([ROOT / "launch_ddp.py", "--config", path, "--print_config"], cwd=tmp_path)
        for path in (tmp_path / "logs" / "config.yaml", run)
    ]
    assert printed[0].returncode == 0, printed[0].stderr
    assert yaml.safe_load(printed[0].stdout) == written
    # The original file without the command line's --epochs 1 differs only there.
    assert {k: v for k, v in yaml.safe_load(printed[1].stdout).items() if k != "epochs"} == {
        k: v for k, v in written.items() if k != "epochs"
    }

"""Config presets and precedence; the curve-plotting command."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from PIL import Image

from conftest import SRC, assert_user_error, run_cli, user_error_line
from imgtrainer.config import DEMO_PRESET, parse_config


def test_defaults_match_the_documented_ones():
    cfg = parse_config([])
    assert (cfg.train_dir, cfg.val_dir, cfg.epochs, cfg.batch_size, cfg.learning_rate) == (
        "data/train",
        "data/val",
        50,
        32,
        0.001,
    )
    assert (cfg.optimizer, cfg.scheduler, cfg.lr_scaling, cfg.model, cfg.image_size) == (
        "adamw",
        "cosine",
        "none",
        "resnet18",
        224,
    )
    assert (cfg.amp_dtype, cfg.checkpoint_dir, cfg.log_dir, cfg.seed) == (
        "float16",
        "checkpoints",
        "logs",
        42,
    )


def test_demo_preset_applies_but_explicit_flags_win():
    cfg = parse_config(["--demo", "--epochs", "3"])
    assert cfg.epochs == 3  # explicit wins
    assert cfg.image_size == DEMO_PRESET["image_size"]  # preset fills the rest
    assert cfg.train_dir == "data/demo/train"


def test_config_is_frozen_and_plain():
    cfg = parse_config([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 3  # type: ignore[misc]
    # Saved in every checkpoint, loaded with weights_only=True: plain values only.
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in cfg.to_dict().values())


def test_demo_data_is_written_once_and_rewritten_when_interrupted(tmp_path: Path):
    from imgtrainer.data.demo import DEMO_IMAGE_SIZE, write_demo_dataset

    train, val = write_demo_dataset(tmp_path / "demo")
    counts = {
        split: {d.name: len(list(d.glob("*.png"))) for d in folder.iterdir()}
        for split, folder in (("train", train), ("val", val))
    }
    assert sorted(counts["train"]) == sorted(counts["val"]) == [str(d) for d in range(10)]
    assert sum(counts["train"].values()) + sum(counts["val"].values()) == 1797
    assert sum(counts["val"].values()) == 360  # 20 %, stratified
    assert all(15 <= n <= 40 for n in counts["val"].values())
    with Image.open(next((val / "3").glob("*.png"))) as image:
        assert image.size == (DEMO_IMAGE_SIZE, DEMO_IMAGE_SIZE) and image.mode == "L"

    stray = train / "0" / "stray.png"
    stray.write_bytes(b"written after the marker")
    write_demo_dataset(tmp_path / "demo")  # complete: reused
    assert stray.exists()
    (tmp_path / "demo" / ".complete").unlink()  # interrupted: redone
    write_demo_dataset(tmp_path / "demo")
    assert not stray.exists() and len(list(train.rglob("*.png"))) == 1797 - 360


def write_history(path: Path) -> Path:
    """Three epochs; the second not validated (--val_every_epochs 2 writes no val_* keys)."""
    records = [
        {
            "epoch": e,
            "train_loss": 2.0 / e,
            "train_acc": 0.3 * e,
            **({"val_loss": 2.1 / e, "val_acc": 0.25 * e, "val_top5": 0.3 * e} if e != 2 else {}),
            "lr": 0.001 / e,
        }
        for e in (1, 2, 3)
    ]
    path.write_text(
        json.dumps({"config": {"model": "resnet18"}, "world_size": 2, "epochs": records})
    )
    return path


def test_plot_writes_a_png_without_importing_torch(tmp_path: Path):
    history = write_history(tmp_path / "h.json")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import utils; "
        "utils.main(['--history', sys.argv[2], '--output', sys.argv[3]]); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = run_cli(["-c", code, SRC, history, tmp_path / "c.png"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    with Image.open(tmp_path / "c.png") as image:
        assert image.format == "PNG" and image.width > 1000


def test_plot_missing_history_exits_2_through_the_command_line(tmp_path: Path):
    result = run_cli(
        [SRC / "utils.py", "--history", tmp_path / "h.json", "--output", tmp_path / "c.png"],
        cwd=tmp_path,
    )
    assert_user_error(result, "does not exist")
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize(
    "content, phrase",
    [
        ("{not json", "not a training history"),
        ('{"epochs": "x"}', "not a training history"),
        ('{"epochs": []}', "no finished epoch"),
    ],
)
def test_plot_bad_history_is_one_clear_error(tmp_path: Path, capsys, content, phrase):
    import imgtrainer.tools.plot as utils

    history = tmp_path / "h.json"
    history.write_text(content)
    line = user_error_line(
        utils.main, ["--history", history, "--output", tmp_path / "c.png"], capsys
    )
    assert phrase in line
    assert not (tmp_path / "c.png").exists()

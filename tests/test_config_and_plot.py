"""Config presets and precedence; the curve-plotting command."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from config import DEMO_PRESET, TrainConfig, parse_config
from conftest import SRC, assert_user_error, run_cli


def test_defaults_match_the_documented_ones():
    cfg = parse_config([])
    assert (cfg.train_dir, cfg.val_dir, cfg.epochs, cfg.batch_size, cfg.learning_rate) == (
        "data/train", "data/val", 50, 32, 0.001)
    assert (cfg.optimizer, cfg.scheduler, cfg.lr_scaling, cfg.model, cfg.image_size) == (
        "adamw", "cosine", "none", "resnet18", 224)
    assert (cfg.amp_dtype, cfg.checkpoint_dir, cfg.log_dir, cfg.seed) == (
        "float16", "checkpoints", "logs", 42)


def test_demo_preset_applies_but_explicit_flags_win():
    cfg = parse_config(["--demo", "--epochs", "3"])
    assert cfg.epochs == 3                                   # explicit wins
    assert cfg.image_size == DEMO_PRESET["image_size"]       # preset fills the rest
    assert cfg.train_dir == "data/demo/train"


def test_config_is_frozen_and_plain():
    cfg = parse_config([])
    with pytest.raises(Exception):
        cfg.epochs = 3  # type: ignore[misc]
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in cfg.to_dict().values())
    assert set(cfg.to_dict()) == {f for f in TrainConfig.__dataclass_fields__}


def write_history(path: Path) -> Path:
    records = [{"epoch": e, "train_loss": 2.0 / e, "train_acc": 0.3 * e, "val_loss": 2.1 / e,
                "val_acc": 0.25 * e, "val_top5": 0.3 * e, "lr": 0.001 / e} for e in (1, 2, 3)]
    path.write_text(json.dumps({"config": {"model": "resnet18"}, "world_size": 2,
                                "epochs": records}))
    return path


def test_plot_writes_a_png(tmp_path: Path):
    history = write_history(tmp_path / "h.json")
    result = run_cli([SRC / "utils.py", "--history", history, "--output", tmp_path / "c.png"],
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    with Image.open(tmp_path / "c.png") as image:
        assert image.format == "PNG" and image.width > 1000


@pytest.mark.parametrize("content, phrase", [(None, "does not exist"),
                                             ("{not json", "not a training history"),
                                             ('{"epochs": "x"}', "not a training history"),
                                             ('{"epochs": []}', "no finished epoch")])
def test_plot_bad_history_is_one_clear_error(tmp_path: Path, content, phrase):
    history = tmp_path / "h.json"
    if content is not None:
        history.write_text(content)
    result = run_cli([SRC / "utils.py", "--history", history, "--output", tmp_path / "c.png"],
                     cwd=tmp_path)
    assert_user_error(result, phrase)
    assert not (tmp_path / "c.png").exists()


def test_plotting_never_imports_torch(tmp_path: Path):
    history = write_history(tmp_path / "h.json")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import utils; "
            "utils.main(['--history', sys.argv[2], '--output', sys.argv[3]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = run_cli(["-c", code, SRC, history, tmp_path / "c.png"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr

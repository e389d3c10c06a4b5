"""bench/recipes.py's own logic: which rows run, the commands they run, the table's figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from imgtrainer.errors import UserError


def load_recipes():
    spec = importlib.util.spec_from_file_location("bench_recipes", ROOT / "bench" / "recipes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


recipes = load_recipes()


def names(argv: list[str]) -> list[str]:
    return [name for _, name, _ in recipes.selected(recipes.parse_args(argv))]


def test_mean_and_spread_over_seeds():
    assert recipes.mean_std([0.5, 0.6, 0.7]) == "60.0±10.0"
    assert recipes.mean_std([0.25, None]) == "25.0"  # a seed that measured nothing is left out
    assert recipes.mean_std([None]) == "-"


def test_fine_tuning_rows_need_a_checkpoint_and_run_apart(tmp_path: Path):
    plain = names(["--data", str(tmp_path)])
    assert "defaults" in plain and not any(n.startswith("fine-tune") for n in plain)
    tuned = names(["--data", str(tmp_path), "--pretrained_path", "x.pth"])
    assert tuned and all(n in recipes.FINETUNE_CONFIGS for n in tuned)
    with pytest.raises(UserError, match="--pretrained_path"):
        names(["--only", "defaults,fine-tune recipe"])
    # With --only, the rows named, in that order, scratch and fine-tuning together.
    assert names(["--only", "fine-tune recipe,defaults", "--pretrained_path", "x.pth"]) == [
        "fine-tune recipe",
        "defaults",
    ]


def test_each_seed_runs_in_its_own_folder_with_the_checkpoint_given(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(
        recipes, "run_logged", lambda command, log, env: (commands.append(command), (0, 1.0))[1]
    )
    args = recipes.parse_args(
        ["--data", str(tmp_path), "--work", str(tmp_path / "w"), "--seeds", "3,4"]
    )
    args.pretrained_path = tmp_path / "pre.pth"
    flags = recipes.FINETUNE_CONFIGS["fine-tune recipe"]
    rows = [recipes.run_launcher("fine-tune recipe", flags, args, set(flags), s) for s in (3, 4)]
    assert [row.seed for row in rows] == [3, 4]
    for command, seed in zip(commands, (3, 4), strict=True):
        assert "PRETRAINED" not in command
        assert command[command.index("--pretrained_path") + 1] == str(tmp_path / "pre.pth")
        assert command[command.index("--seed") + 1] == str(seed)
        folder = command[command.index("--checkpoint_dir") + 1]
        assert folder == str(tmp_path / "w" / "fine_tune_recipe" / f"seed_{seed}" / "checkpoints")

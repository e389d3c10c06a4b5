"""Reports that scale with the class count, precise messages for bad checkpoint files, and
command-line tools that stop quietly when their reader goes away."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, SRC, tiny_run_flags, write_image_folder
from imgtrainer.checkpoints.files import CheckpointError, load_checkpoint_file
from imgtrainer.models import build_model
from imgtrainer.reports.confusion import FULL_MATRIX_MAX_CLASSES, most_confused_pairs
from imgtrainer.tools.evaluate import main as evaluate_main


def test_most_confused_pairs_by_count_then_matrix_order():
    confusion = np.array([[5, 2, 0], [3, 1, 3], [0, 1, 4]])
    assert most_confused_pairs(confusion, 3) == [(1, 0, 3), (1, 2, 3), (0, 1, 2)]
    assert most_confused_pairs(confusion, 10) == [(1, 0, 3), (1, 2, 3), (0, 1, 2), (2, 1, 1)]
    assert most_confused_pairs(np.eye(3, dtype=np.int64), 5) == []  # no mistakes, no pairs


@pytest.mark.slow
def test_evaluate_on_a_thousand_classes_writes_the_summary_and_the_csv(tmp_path: Path):
    classes = [f"c{k:04d}" for k in range(1000)]
    assert len(classes) > FULL_MATRIX_MAX_CLASSES
    write_image_folder(tmp_path / "val", classes, per_class=1, size=16)
    torch.manual_seed(0)
    torch.save(
        {
            "model_state_dict": build_model("resnet18", len(classes)).state_dict(),
            "class_names": classes,
            "image_size": 16,
            "model_name": "resnet18",
        },
        tmp_path / "checkpoint.pth",
    )
    code = evaluate_main(
        [
            "--checkpoint",
            str(tmp_path / "checkpoint.pth"),
            "--data_dir",
            str(tmp_path / "val"),
            "--output",
            str(tmp_path / "eval"),
            "--device",
            "cpu",
            "--num_workers",
            "0",
        ]
    )
    assert code == 0
    report = tmp_path / "eval"
    assert (report / "confusion_summary.png").stat().st_size > 0
    assert not (report / "confusion_matrix.png").exists()  # unreadable at this size
    metrics = json.loads((report / "metrics.json").read_text())
    assert (
        "confusion_matrix" not in metrics
        and metrics["confusion_matrix_csv"] == "confusion_matrix.csv"
    )
    with open(report / "confusion_matrix.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][1:] == classes and [row[0] for row in rows[1:]] == classes
    matrix = np.array([[int(v) for v in row[1:]] for row in rows[1:]])
    assert matrix.shape == (1000, 1000)
    assert matrix.sum(axis=1).tolist() == [1] * 1000  # one image per class
    assert int(np.trace(matrix)) == metrics["correct"]


@pytest.mark.parametrize(
    "content, phrase",
    [
        (
            bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8)),
            "is not a readable PyTorch checkpoint",
        ),
        (b"epoch,loss\n1,0.5\n", "is not a readable PyTorch checkpoint"),
    ],
)
def test_a_file_that_is_no_checkpoint_is_named_so(tmp_path: Path, content: bytes, phrase: str):
    path = tmp_path / "model.pth"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=phrase) as err:
        load_checkpoint_file(path)
    assert "Python objects" not in str(err.value)


def test_a_truncated_checkpoint_is_named_so(tmp_path: Path):
    path = tmp_path / "model.pth"
    torch.save({"weight": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint_file(path)


def test_a_pickle_of_python_objects_keeps_the_unsafe_message(tmp_path: Path):
    path = tmp_path / "model.pth"
    torch.save({"when": __import__("datetime").date(2020, 1, 1)}, path)  # a class, not a tensor
    with pytest.raises(CheckpointError, match="holds code or objects that could run code"):
        load_checkpoint_file(path)


# Both tools stop through the same wrapper (errors.exit_on_user_error); the launcher's new
# interpreter imports no torch, evaluate.py's does (seconds): slow.
@pytest.mark.parametrize(
    "tool", [ROOT / "launch_ddp.py", pytest.param(SRC / "evaluate.py", marks=pytest.mark.slow)]
)
def test_help_into_a_closed_pipe_ends_quietly(tool: Path):
    """`tool --help | head` : the reader is gone before the tool writes."""
    process = subprocess.Popen(
        [sys.executable, str(tool), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    code = process.wait(timeout=120)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    # 141 (128 + SIGPIPE) where the tool noticed; argparse's own help swallows the error.
    assert code in (0, 141), (code, stderr)


def test_ddp_is_built_without_the_deprecated_buffer_flag(tmp_path: Path):
    """torch 2.14 warns at every DDP built with broadcast_buffers; the trainer's choice of
    flag keeps the behaviour (no buffer broadcast in each forward) without the warning."""
    import warnings

    import torch.distributed as torch_dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from imgtrainer.torch_compat import no_forward_buffer_sync

    store = torch_dist.FileStore(str(tmp_path / "store"), 1)
    torch_dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DDP(
                torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)),
                **no_forward_buffer_sync(),
            )
        assert not [w for w in caught if issubclass(w.category, FutureWarning)], caught
        # Whichever name this torch knows, buffers are not synced in each forward.
        assert (
            getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False
        )
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.slow
def test_timm_loads_our_best_checkpoint(tiny_dataset, tmp_path: Path, monkeypatch):
    """timm's load_checkpoint (what its validate.py calls) and create_model(checkpoint_path=)
    read the `state_dict` key of a checkpoint written by a real training run."""
    import timm
    from timm.models import load_checkpoint

    from imgtrainer.run.train import main as train_main

    train, val = tiny_dataset
    monkeypatch.chdir(tmp_path)
    assert train_main(["--device", "cpu", *tiny_run_flags(train, val), "--epochs", "1"]) == 0
    best = tmp_path / "checkpoints" / "checkpoint_best.pth"
    saved = torch.load(best, map_location="cpu", weights_only=True)
    model = timm.create_model("test_resnet", num_classes=3)
    load_checkpoint(model, str(best))  # strict: every key must match
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved["model_state_dict"][name]), name
    built = timm.create_model("test_resnet", num_classes=3, checkpoint_path=str(best))
    assert torch.equal(built.fc.weight, saved["model_state_dict"]["fc.weight"])


def test_help_lists_every_trainer_flag_once_in_its_group():
    import dataclasses

    from imgtrainer.config import HELP_GROUPS, TrainConfig, build_parser

    grouped = [name for names in HELP_GROUPS.values() for name in names]
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    assert sorted(grouped) == sorted(fields)  # none left out, none twice
    help_text = build_parser().format_help()
    titles = [f"{title}:" for title in HELP_GROUPS]
    assert all(title in help_text.splitlines() for title in titles), help_text
    # Each flag appears under its own group's title.
    for title, names in HELP_GROUPS.items():
        section = help_text.split(f"\n{title}:\n", 1)[1].split("\n\n", 1)[0]
        for name in names:
            assert f"--{name}" in section, (title, name)

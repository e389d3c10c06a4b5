"""src/evaluate.py: the report files match a hand-computed confusion matrix; two processes under
torchrun give the report of one; bad checkpoints and folders are one error line."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import imgtrainer.tools.inference as inference
from conftest import SRC, assert_user_error, run_cli, user_error_line, write_image_folder
from imgtrainer.models import build_model
from imgtrainer.reports.confusion import balanced_accuracy, macro_f1
from imgtrainer.tools.evaluate import main as evaluate_main

CLASSES = ["a", "b", "c"]
RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


class ChannelMeans(nn.Module):
    """Logits = the mean of each normalised colour channel: with mean = std = 0.5 a solid red
    image gives logits (1, -1, -1), so red is predicted "a", green "b", blue "c"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def solid_images(folder: Path, colours: list[tuple[int, int, int]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, colour in enumerate(colours):
        Image.new("RGB", (16, 16), colour).save(folder / f"img_{i}.png")


def hand_checkpoint(path: Path, model_name: str = "channel_means", weights=None) -> Path:
    torch.save(
        {
            "model_state_dict": weights or {},
            "class_names": CLASSES,
            "image_size": 16,
            "mean": [0.5] * 3,
            "std": [0.5] * 3,
            "model_name": model_name,
        },
        path,
    )
    return path


def run_evaluate(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = evaluate_main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_report_matches_a_hand_computed_confusion_matrix(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(inference, "build_model", lambda name, classes: ChannelMeans())
    data = tmp_path / "val"
    solid_images(data / "a", [RED, RED, RED, GREEN])  # 3 right, 1 taken for b
    solid_images(data / "b", [RED, GREEN, GREEN])  # 1 taken for a, 2 right
    solid_images(data / "c", [GREEN, BLUE, BLUE])  # 1 taken for b, 2 right
    (data / "c" / "notes.txt").write_text("not an image")
    checkpoint = hand_checkpoint(tmp_path / "ckpt.pth")

    code, out, _ = run_evaluate(
        [
            "--checkpoint",
            checkpoint,
            "--data_dir",
            data,
            "--output",
            tmp_path / "eval",
            "--num_workers",
            "0",
            "--device",
            "cpu",
        ],
        capsys,
    )
    assert code == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["confusion_matrix"] == [[3, 1, 0], [1, 2, 0], [0, 1, 2]]
    assert metrics["images"] == 10 and metrics["correct"] == 7 and metrics["misclassified"] == 3
    assert metrics["top1"] == pytest.approx(0.7) and metrics["top5"] == 1.0
    # Logits (1, -1, -1) up to the order: loss log(e + 2/e) - 1 when right, + 1 when wrong.
    base = math.log(math.e + 2 / math.e)
    assert metrics["loss"] == pytest.approx((7 * (base - 1) + 3 * (base + 1)) / 10, abs=1e-5)
    per_class = metrics["per_class"]
    assert [per_class[c]["precision"] for c in CLASSES] == pytest.approx([3 / 4, 2 / 4, 2 / 2])
    assert [per_class[c]["recall"] for c in CLASSES] == pytest.approx([3 / 4, 2 / 3, 2 / 3])
    assert [per_class[c]["accuracy"] for c in CLASSES] == pytest.approx([3 / 4, 2 / 3, 2 / 3])
    assert [per_class[c]["images"] for c in CLASSES] == [4, 3, 3]
    assert per_class["c"]["most_confused_with"] == {"class": "b", "images": 1}
    # Every class counts the same: the mean recall, and the mean F1 = 2 TP / (images + predicted).
    assert metrics["balanced_accuracy"] == pytest.approx((3 / 4 + 2 / 3 + 2 / 3) / 3)
    assert metrics["macro_f1"] == pytest.approx((6 / 8 + 4 / 7 + 4 / 5) / 3)

    with open(tmp_path / "eval" / "misclassified.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(
        (Path(r["path"]).parent.name, r["true_class"], r["predicted_class"]) for r in rows
    ) == [("a", "a", "b"), ("b", "b", "a"), ("c", "c", "b")]
    confidence = math.e / (math.e + 2 / math.e)
    assert all(float(r["confidence"]) == pytest.approx(confidence, abs=1e-4) for r in rows)

    png = tmp_path / "eval" / "confusion_matrix.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Worst 3 classes by accuracy" in out and "top-1 0.7000" in out
    assert f"balanced accuracy {metrics['balanced_accuracy']:.4f}  macro F1" in out


def test_balanced_accuracy_and_macro_f1_count_classes_as_scikit_learn_does():
    """balanced_accuracy_score leaves out classes without images; f1_score(average="macro")
    averages over the classes with images or predictions, 0 for one never predicted right.
    (Checked against scikit-learn when written; its import would cost this test seconds.)"""
    confusion = np.array(
        [
            [3, 1, 0, 0, 0],
            [0, 2, 0, 1, 0],
            [0, 0, 0, 0, 0],  # no image, predicted once (for an image of class 3)
            [0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0],  # neither images nor predictions: not counted
        ]
    )
    assert balanced_accuracy(confusion) == pytest.approx((3 / 4 + 2 / 3 + 0) / 3)
    assert macro_f1(confusion) == pytest.approx((6 / 7 + 4 / 6 + 0 + 0) / 4)


def random_checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    return hand_checkpoint(path, "resnet18", build_model("resnet18", len(CLASSES)).state_dict())


@pytest.mark.slow
def test_two_processes_under_torchrun_write_the_report_of_one(tmp_path: Path, capsys):
    data = write_image_folder(tmp_path / "val", CLASSES, per_class=5, seed=3)  # 15: uneven shards
    (data / "b" / "broken.jpg").write_bytes(b"not a jpeg")
    checkpoint = random_checkpoint(tmp_path / "ckpt.pth")
    common = [
        "--checkpoint",
        checkpoint,
        "--data_dir",
        data,
        "--batch_size",
        "4",
        "--num_workers",
        "0",
        "--device",
        "cpu",
    ]
    code, single_out, _ = run_evaluate([*common, "--output", tmp_path / "one"], capsys)
    double = run_cli(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            SRC / "evaluate.py",
            *common,
            "--output",
            tmp_path / "two",
        ],
        cwd=tmp_path,
    )
    assert code == 0
    assert double.returncode == 0, double.stderr
    assert single_out.count("cannot be decoded") == 1
    assert double.stdout.count("cannot be decoded") == 1  # printed by one process only

    one, two = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("one", "two"))
    assert one["images"] == two["images"] == 15
    assert one["unreadable_images_left_out"] == two["unreadable_images_left_out"] == 1
    assert one["confusion_matrix"] == two["confusion_matrix"]
    assert one["per_class"] == two["per_class"]
    assert one["top1"] == two["top1"] and one["top5"] == two["top5"]
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-6)
    rows = [(tmp_path / d / "misclassified.csv").read_text().splitlines() for d in ("one", "two")]
    assert len(rows[0]) == 1 + one["misclassified"]
    assert sorted(r.rsplit(",", 1)[0] for r in rows[0]) == sorted(
        r.rsplit(",", 1)[0] for r in rows[1]
    )
    assert (tmp_path / "two" / "evaluate_rank_1.log").exists()


def missing_checkpoint_args(tmp_path: Path) -> list:
    """evaluate.py's flags for a checkpoint that does not exist, on a real validation folder."""
    write_image_folder(tmp_path / "val", CLASSES, 1)
    return [
        "--checkpoint",
        tmp_path / "nope.pth",
        "--data_dir",
        tmp_path / "val",
        "--output",
        tmp_path / "eval",
    ]


def test_missing_checkpoint_is_one_error_line_in_process(tmp_path: Path, capsys):
    line = user_error_line(
        evaluate_main,
        missing_checkpoint_args(tmp_path),
        capsys,
        cwd=tmp_path,
    )
    assert "nope.pth" in line and "does not exist" in line


@pytest.mark.slow
def test_missing_checkpoint_is_one_error_line(tmp_path: Path):
    """The same from a new interpreter: exit code 2."""
    result = run_cli(
        [
            SRC / "evaluate.py",
            *missing_checkpoint_args(tmp_path),
        ],
        cwd=tmp_path,
    )
    assert_user_error(result, "nope.pth", "does not exist")


def test_checkpoint_of_another_tool_is_refused(tmp_path: Path, capsys):
    write_image_folder(tmp_path / "val", CLASSES, 1)
    bare = tmp_path / "bare.pth"
    torch.save(build_model("resnet18", 3).state_dict(), bare)  # a plain state dict
    assert "class_names" in user_error_line(
        evaluate_main,
        ["--checkpoint", bare, "--data_dir", tmp_path / "val", "--output", tmp_path / "eval"],
        capsys,
    )


def test_folder_with_classes_the_checkpoint_does_not_know(tmp_path: Path, capsys):
    write_image_folder(tmp_path / "val", ["a", "zebra"], 1)
    checkpoint = random_checkpoint(tmp_path / "ckpt.pth")
    assert "zebra" in user_error_line(
        evaluate_main,
        ["--checkpoint", checkpoint, "--data_dir", tmp_path / "val", "--output", tmp_path / "eval"],
        capsys,
    )


def test_folder_with_some_of_the_classes_is_evaluated(tmp_path: Path, capsys):
    write_image_folder(tmp_path / "val", ["b"], 3)
    checkpoint = random_checkpoint(tmp_path / "ckpt.pth")
    code, _, _ = run_evaluate(
        [
            "--checkpoint",
            checkpoint,
            "--data_dir",
            tmp_path / "val",
            "--output",
            tmp_path / "eval",
            "--num_workers",
            "0",
        ],
        capsys,
    )
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert code == 0 and metrics["images"] == 3
    assert np.array(metrics["confusion_matrix"]).sum(axis=1).tolist() == [0, 3, 0]
    assert metrics["per_class"]["a"]["recall"] is None

"""One evaluation path: src/evaluate.py's report comes from training's own evaluation pass, so it gives
the val_acc training recorded, with the checkpoint's autocast; the inference tools share their
argument checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TrainedRun, folder_images, run_main, user_error_line
from imgtrainer.config import TrainConfig
from imgtrainer.data.host.samplers import ShardSampler
from imgtrainer.data.host.samples import SeededImageDataset
from imgtrainer.data.loaders import LoaderSpec, make_loader
from imgtrainer.precision import Precision, choose_precision
from imgtrainer.tools.evaluate import main as evaluate_main
from imgtrainer.tools.inference import load_classifier, training_precision
from imgtrainer.tools.predict import main as predict_main
from imgtrainer.training.evaluation import EvalSettings, evaluate


def evaluate_report(checkpoint: Path, data_dir: Path, output: Path) -> dict:
    code = run_main(
        evaluate_main,
        [
            "--checkpoint",
            checkpoint,
            "--data_dir",
            data_dir,
            "--output",
            output,
            "--device",
            "cpu",
            "--num_workers",
            "0",
            "--batch_size",
            "8",
        ],
    )
    assert code == 0
    return json.loads((output / "metrics.json").read_text())


def test_report_gives_the_val_acc_training_recorded(trained_run: TrainedRun, tmp_path: Path):
    state = torch.load(trained_run.best, weights_only=True)
    history = json.loads((trained_run.root / "logs" / "training_history.json").read_text())
    record = next(r for r in history["epochs"] if r["epoch"] == state["epoch"])
    metrics = evaluate_report(trained_run.best, trained_run.val, tmp_path / "eval")
    assert metrics["images"] == 15  # the tiny val folder, all of it
    # Exactly, not approximately: the same pass over the same images with the same weights.
    assert metrics["top1"] == record["val_acc"] == state["best_acc"]
    assert metrics["top5"] == record["val_top5"]
    assert metrics["loss"] == record["val_loss"]


def test_report_runs_under_the_checkpoints_autocast(trained_run: TrainedRun, tmp_path: Path):
    """A checkpoint trained with --use_amp on the CPU was validated under bfloat16 autocast: the
    report's loss is that pass's, to the last bit, not the float32 one."""
    state = torch.load(trained_run.best, weights_only=True)
    state["config"] = {**state["config"], "use_amp": True, "low_memory": False}
    # Smaller logits: the trained model is so sure of the tiny set that its loss is 0 at any
    # precision. (In place: "state_dict" is the same tensors.)
    state["model_state_dict"]["fc.weight"].mul_(0.02)
    torch.save(state, tmp_path / "amp.pth")
    metrics = evaluate_report(tmp_path / "amp.pth", trained_run.val, tmp_path / "eval")

    classifier = load_classifier(tmp_path / "amp.pth", torch.device("cpu"))
    assert classifier.precision == Precision(True, torch.bfloat16)
    folder = folder_images(trained_run.val, classifier.class_names)
    dataset = SeededImageDataset(folder, classifier.transform, seed=0)
    loader = make_loader(
        dataset,
        ShardSampler(len(dataset), 0, 1),
        LoaderSpec(8, train=False, mean=classifier.mean, std=classifier.std),
    )
    cpu = torch.device("cpu")
    amp = evaluate(classifier.model, loader, EvalSettings(cpu, classifier.precision, None, False))
    fp32 = evaluate(
        classifier.model, loader, EvalSettings(cpu, Precision(False, torch.float32), None, False)
    )
    assert amp["val_loss"] != fp32["val_loss"]  # else this test could not tell them apart
    assert metrics["loss"] == amp["val_loss"]
    assert metrics["top1"] == amp["val_acc"]


@pytest.mark.parametrize(
    "config, device, expected",
    [
        ({}, "cuda", Precision(False, torch.float32)),  # a file without a config
        ({"use_amp": True}, "cuda", Precision(True, torch.float16)),
        ({"use_amp": True, "amp_dtype": "bfloat16"}, "cuda", Precision(True, torch.bfloat16)),
        ({"use_amp": True}, "cpu", Precision(True, torch.bfloat16)),
        ({"use_amp": True, "low_memory": True}, "cpu", Precision(False, torch.float32)),
        ({"use_amp": True, "low_memory": True}, "cuda", Precision(True, torch.float16)),
    ],
)
def test_inference_reads_the_precision_rule_from_the_checkpoint(config, device, expected):
    """The tools replay training's autocast (``precision_rule``) from the saved config."""
    assert training_precision(config, torch.device(device)) == expected
    if config:
        cfg = TrainConfig(**config)
        assert choose_precision(cfg, torch.device(device)) == expected


@pytest.mark.parametrize("main", [evaluate_main, predict_main], ids=["evaluate", "predict"])
@pytest.mark.parametrize(
    "flag, value, phrase",
    [
        ("--batch_size", "0", "--batch_size must be positive"),
        ("--num_workers", "-1", "--num_workers must be 0 or more"),
    ],
)
def test_inference_tools_check_their_shared_flags_alike(
    main, flag: str, value: str, phrase: str, tmp_path: Path, capsys
):
    argv = ["--checkpoint", tmp_path / "missing.pth", flag, value]
    if main is predict_main:
        argv.append(tmp_path)
    assert phrase in user_error_line(main, argv, capsys)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_report_gives_the_val_acc_of_a_float16_channels_last_run_on_cuda(tmp_path: Path):
    """On a GPU training validates under float16 autocast in channels_last: the report runs the
    same way and gives the recorded val_acc."""
    import imgtrainer.run.train as train_ddp
    from conftest import run_main, tiny_run_flags, write_tiny_dataset

    train, val = write_tiny_dataset(tmp_path)
    code = run_main(
        train_ddp.main,
        ["--device", "cuda", *tiny_run_flags(train, val), "--epochs", "1", "--use_amp"],
        cwd=tmp_path,
    )
    assert code == 0
    best = tmp_path / "checkpoints" / "checkpoint_best.pth"
    classifier = load_classifier(best, torch.device("cuda"))
    assert classifier.precision == Precision(True, torch.float16) and classifier.plan.channels_last
    history = json.loads((tmp_path / "logs" / "training_history.json").read_text())
    code = run_main(
        evaluate_main,
        [
            "--checkpoint",
            best,
            "--data_dir",
            val,
            "--output",
            tmp_path / "eval",
            "--device",
            "cuda",
            "--num_workers",
            "0",
            "--batch_size",
            "8",
        ],
    )
    assert code == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["top1"] == history["epochs"][0]["val_acc"]
    # cudnn may choose other kernels than training's benchmark mode did: the loss to float16's
    # precision, not bitwise.
    assert metrics["loss"] == pytest.approx(history["epochs"][0]["val_loss"], rel=1e-2, abs=1e-3)

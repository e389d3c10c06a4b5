"""src/export.py: each format writes a model that gives the checkpoint's outputs and the JSON of
its preprocessing; a model whose outputs differ fails the check (exit 1) and is not written; bad
input is one error line (exit 2)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import imgtrainer.tools.export as export
from conftest import run_main, user_error_line
from imgtrainer.checkpoints.files import load_checkpoint_file
from imgtrainer.tools.inference import load_classifier

CPU = torch.device("cpu")


def export_argv(run, output: Path, fmt: str, *more) -> list:
    return ["--checkpoint", run.best, "--format", fmt, "--output", output, *more]


def checked_export(run, tmp_path: Path, fmt: str, capsys) -> tuple[Path, dict]:
    """Exports the shared run's best checkpoint; returns the file and its JSON."""
    output = tmp_path / f"model{export.SUFFIXES[fmt]}"
    assert run_main(export.main, export_argv(run, output, fmt)) == 0
    out = capsys.readouterr().out
    assert f"Wrote {output}" in out and "8/8 top-1 predictions agree" in out
    info = json.loads(export.preprocessing_path(output).read_text())
    assert info["format"] == fmt and info["file"] == output.name
    assert info["class_names"] == ["cat", "dog", "fox"] and info["model_name"] == "resnet18"
    assert info["image_size"] == 16 and info["resize_side"] == 19  # ceil(16 / 0.875)
    assert info["mean"] == pytest.approx([0.485, 0.456, 0.406]) and info["weights"] == "raw"
    # The checkpoint's --val_dir holds 15 images: the check took 8 of them.
    check = info["check"]
    assert check["images"] == 8 and check["images_from"] == f"8 images of {run.val}"
    assert check["max_abs_diff"] <= 1e-4 and check["same_top1"] == 8
    assert not list(tmp_path.glob(".*"))  # no temporary file left
    return output, info


def test_safetensors_holds_the_checkpoints_weights(trained_run, tmp_path: Path, capsys):
    from safetensors.torch import load_file

    output, _ = checked_export(trained_run, tmp_path, "safetensors", capsys)
    saved = load_checkpoint_file(trained_run.best)["model_state_dict"]
    weights = load_file(str(output))
    assert weights.keys() == saved.keys()
    assert all(torch.equal(weights[name], saved[name]) for name in saved)


@pytest.mark.slow
def test_torchscript_runs_any_batch_size_as_the_checkpoint(trained_run, tmp_path: Path, capsys):
    output, _ = checked_export(trained_run, tmp_path, "torchscript", capsys)
    # The check ran 8 images through a model traced on 2: a plain load runs any batch size.
    assert export.run_torchscript(output, None, torch.randn(3, 3, 16, 16)).shape == (3, 3)


ONNX_MISSING = [
    name for name in export.FORMAT_PACKAGES["onnx"] if importlib.util.find_spec(name) is None
]


@pytest.mark.slow
@pytest.mark.skipif(bool(ONNX_MISSING), reason=f"not installed: {ONNX_MISSING}")
def test_onnx_runs_any_batch_size_as_the_checkpoint(trained_run, tmp_path: Path, capsys):
    output, info = checked_export(trained_run, tmp_path, "onnx", capsys)
    assert info["input"]["name"] == "images" and info["output"]["name"] == "logits"
    # Exported from a batch of 2, checked on 8: the batch size is dynamic.
    assert export.run_onnx(output, None, torch.randn(3, 3, 16, 16)).shape == (3, 3)


def test_outputs_beyond_the_tolerance_fail_and_write_nothing(
    trained_run, tmp_path: Path, monkeypatch, capsys
):
    def perturbed(model: torch.nn.Module, example: torch.Tensor) -> bytes:
        changed = copy.deepcopy(model)
        with torch.no_grad():
            changed.get_classifier().bias.add_(0.01)
        return export.safetensors_bytes(changed, example)

    monkeypatch.setitem(
        export.FORMATS, "safetensors", export.ExportFormat(perturbed, export.run_safetensors)
    )
    output = tmp_path / "out" / "model.safetensors"
    code = run_main(
        export.main,
        export_argv(trained_run, output, "safetensors", "--atol", "0.005", "--rtol", "0"),
    )
    err = capsys.readouterr().err
    assert code == export.EXIT_CHECK_FAILED == 1
    assert "error: export check failed on safetensors" in err and "up to 0.01" in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_compare_outputs_uses_absolute_plus_relative_tolerance():
    reference = torch.tensor([[10.0, -1.0]])
    within = reference + torch.tensor([[0.0105, 0.0015]])  # 1e-3 + 1e-3 x |logit| each
    assert export.compare_outputs(within, reference, 1e-3, 1e-3)["max_abs_diff"] > 0.01
    with pytest.raises(export.CheckFailed, match="1/1 top-1 predictions agree"):
        export.compare_outputs(reference + torch.tensor([[0.0, 0.0025]]), reference, 1e-3, 1e-3)


def test_random_images_without_a_folder(trained_run):
    classifier = load_classifier(trained_run.best, CPU, "raw")
    images, source = export.check_inputs(classifier, None, 3)
    assert images.shape == (3, 3, 16, 16) and images.dtype == torch.float32
    assert source.startswith("3 random images")


def test_bad_input_is_one_error_line(trained_run, tmp_path: Path, capsys, monkeypatch):
    missing = tmp_path / "none.pth"
    line = user_error_line(
        export.main, ["--checkpoint", missing, "--format", "torchscript"], capsys
    )
    assert "does not exist" in line
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"not a checkpoint" * 10)
    argv = ["--checkpoint", corrupt, "--format", "safetensors"]
    line = user_error_line(export.main, argv, capsys)
    assert "corrupt.pth" in line
    argv = ["--checkpoint", trained_run.best, "--format", "tflite"]
    assert run_main(export.main, argv) == 2
    assert "invalid choice: 'tflite'" in capsys.readouterr().err
    folder = ["--check_images", tmp_path / "nothing_here"]
    argv = export_argv(trained_run, tmp_path / "m.torchscript", "torchscript", *folder)
    assert "is not a folder" in user_error_line(export.main, argv, capsys)
    argv = export_argv(trained_run, trained_run.best, "safetensors")
    assert "is the checkpoint itself" in user_error_line(export.main, argv, capsys)
    monkeypatch.setitem(export.FORMAT_PACKAGES, "onnx", ("onnx", "no_such_package_for_export"))
    line = user_error_line(
        export.main, ["--checkpoint", trained_run.best, "--format", "onnx"], capsys
    )
    assert "no_such_package_for_export" in line and "requirements-export.txt" in line


def test_a_model_the_exporter_cannot_handle_is_one_error_line(
    trained_run, tmp_path: Path, monkeypatch, capsys
):
    def unsupported(model: torch.nn.Module, example: torch.Tensor) -> bytes:
        try:
            raise RuntimeError("Could not export \x1b[96maten::weird_op\x1b[0m\n  (long report)")
        except RuntimeError as reason:  # torch.onnx's way: a generic error, the reason its cause
            raise ValueError("Failed to export. \x1b[96mThis is step 1/3\x1b[0m") from reason

    def unloadable(path: Path, classifier, images: torch.Tensor) -> torch.Tensor:
        assert path.exists()  # the file being checked, removed afterwards
        raise ValueError("Load model failed: unknown op weird_op")

    output = tmp_path / "out" / "model.torchscript"
    argv = export_argv(trained_run, output, "torchscript")
    monkeypatch.setitem(
        export.FORMATS, "torchscript", export.ExportFormat(unsupported, export.run_torchscript)
    )
    line = user_error_line(export.main, argv, capsys)
    assert "torchscript exporter cannot handle the model resnet18" in line
    assert (
        "RuntimeError: Could not export aten::weird_op" in line
        and "long report" not in line
        and "step 1/3" not in line
    )
    assert "try --format onnx or --format safetensors" in line
    assert not output.parent.exists() or not list(output.parent.iterdir())
    monkeypatch.setitem(
        export.FORMATS,
        "torchscript",
        export.ExportFormat(export.safetensors_bytes, unloadable),
    )
    line = user_error_line(export.main, argv, capsys)
    assert "torchscript file exported from the model resnet18 does not run" in line
    assert "ValueError: Load model failed: unknown op weird_op" in line
    assert not list(output.parent.iterdir())  # neither the model nor its pending file

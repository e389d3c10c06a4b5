"""Export a checkpoint for deployment (ONNX, TorchScript or safetensors), checked against it.

    python src/export.py --checkpoint checkpoints/checkpoint_best.pth --format onnx
    python src/export.py --checkpoint checkpoints/checkpoint_best.pth --format safetensors --output deploy/model.safetensors

Its preprocessing goes in a JSON file beside it. The check runs the exported file on a few
validation images and fails (exit 1, nothing written) when its logits differ from PyTorch's by
more than atol + rtol x |logit| (docs/tools.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from imgtrainer.data import open_rgb
from imgtrainer.data.host.transforms import eval_resize_side, normalize_batch
from imgtrainer.errors import UserError, exit_on_user_error, first_line
from imgtrainer.files import atomic_write
from imgtrainer.models import build_model
from imgtrainer.tools.inference import WEIGHTS_CHOICES, Classifier, load_classifier
from imgtrainer.tools.predict import collect_images

# The exit code of an export whose check failed: the tool worked, the exported model did not.
EXIT_CHECK_FAILED = 1


INPUT_NAME, OUTPUT_NAME = "images", "logits"


# The packages each format needs beyond torch, and what for.
FORMAT_PACKAGES = {
    "onnx": ("onnx", "onnxscript", "onnxruntime"),
    "torchscript": (),
    "safetensors": ("safetensors",),
}


SUFFIXES = {"onnx": ".onnx", "torchscript": ".torchscript", "safetensors": ".safetensors"}


class CheckFailed(Exception):
    """The exported model's outputs differ from the checkpoint's beyond the tolerance."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="export.py",
        description="Export a checkpoint to ONNX, TorchScript or safetensors, with its "
        "preprocessing in <output>.json, and check the exported model's outputs.",
    )
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="checkpoint written by src/train_ddp.py"
    )
    parser.add_argument("--format", choices=list(SUFFIXES), required=True, help="export format")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="the exported file (default: beside the checkpoint, its name with .onnx, "
        ".torchscript or .safetensors); the preprocessing goes to <output>.json",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="auto",
        help="which weights of a checkpoint trained with --model_ema, as in evaluate.py "
        "(default: auto)",
    )
    parser.add_argument(
        "--check_images",
        type=Path,
        default=None,
        help="folder of images (searched recursively) for the check (default: the "
        "checkpoint's --val_dir when it exists, else random images)",
    )
    parser.add_argument(
        "--check_count", type=int, default=8, help="images the check runs (default: 8)"
    )
    parser.add_argument(
        "--atol", type=float, default=1e-4, help="absolute tolerance on the logits (default: 1e-4)"
    )
    parser.add_argument(
        "--rtol", type=float, default=1e-3, help="relative tolerance on the logits (default: 1e-3)"
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.check_count < 1:
        raise UserError(f"--check_count must be positive, got {args.check_count}")
    if args.atol < 0 or args.rtol < 0:
        raise UserError(f"--atol and --rtol must be 0 or more, got {args.atol} and {args.rtol}")
    if args.check_images is not None and not args.check_images.is_dir():
        raise UserError(f"--check_images {args.check_images} is not a folder")
    args.output = args.output or args.checkpoint.with_suffix(SUFFIXES[args.format])
    if args.output.is_dir():
        raise UserError(f"--output {args.output} is a folder; give the file to write")
    if args.output.resolve() == args.checkpoint.resolve():
        raise UserError(f"--output {args.output} is the checkpoint itself; give another file")
    return args


def require_packages(fmt: str) -> None:
    """One line naming the optional packages ``fmt`` needs and are not installed."""
    missing = [name for name in FORMAT_PACKAGES[fmt] if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"--format {fmt} needs the package(s) {', '.join(missing)}, not installed: "
            "pip install -r requirements-export.txt"
        )


def preprocessing_path(output: Path) -> Path:
    return output.with_name(output.name + ".json")


# ----------------------------------------------------------------------------- the inputs


def check_inputs(
    classifier: Classifier, folder: Path | None, count: int
) -> tuple[torch.Tensor, str]:
    """A normalised float32 batch for the check, preprocessed as evaluate.py does, and where
    it came from: ``count`` images spread over the sorted files of ``folder``, or random
    images when there is no folder."""
    if folder is None:
        generator = torch.Generator().manual_seed(0)
        size = classifier.image_size
        images = torch.randint(
            0, 256, (count, 3, size, size), dtype=torch.uint8, generator=generator
        )
        source = f"{count} random images (no validation folder found; --check_images DIR)"
    else:
        files = collect_images([folder])
        picks = np.unique(np.linspace(0, len(files) - 1, min(count, len(files))).round())
        chosen = [files[int(i)] for i in picks]
        try:
            images = torch.stack([classifier.transform(open_rgb(path)) for path in chosen])
        except Exception as err:  # any decoder failure on a user's file
            raise UserError(f"cannot read an image of {folder} for the check: {err}") from None
        source = f"{len(chosen)} images of {folder}"
    return normalize_batch(images, classifier.mean, classifier.std), source


def default_check_folder(config: dict[str, Any]) -> Path | None:
    """The training run's --val_dir (from the checkpoint's config), when it is there; a
    relative one is read from the current directory."""
    val_dir = config.get("val_dir")
    return Path(val_dir) if val_dir and Path(val_dir).is_dir() else None


# ----------------------------------------------------------------------------- the formats


def onnx_bytes(model: nn.Module, example: torch.Tensor) -> bytes:
    """The model as an ONNX file, with a dynamic batch size, from torch.export's exporter (the
    default since torch 2.9)."""
    program = torch.onnx.export(
        model,
        (example,),
        dynamo=True,
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        verbose=False,
    )
    return program.model_proto.SerializeToString()


def torchscript_bytes(model: nn.Module, example: torch.Tensor) -> bytes:
    """The model traced with an example batch (tracing works for more timm models than
    scripting)."""
    buffer = io.BytesIO()
    with no_jit_warnings():
        torch.jit.save(torch.jit.trace(model, example, check_trace=False), buffer)
    return buffer.getvalue()


@contextlib.contextmanager
def no_jit_warnings() -> Iterator[None]:
    """torch.jit's deprecation warnings (docs/tools.md says it) and the tracer's notes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.jit")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


def safetensors_bytes(model: nn.Module, example: torch.Tensor) -> bytes:
    """The state dict (timm's keys: ``timm.create_model(name, num_classes=K)`` loads it)."""
    from safetensors.torch import save

    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    return save(state, metadata={"format": "pt"})


def run_onnx(path: Path, classifier: Classifier, images: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {INPUT_NAME: images.numpy()})[0])


def run_torchscript(path: Path, classifier: Classifier, images: torch.Tensor) -> torch.Tensor:
    with no_jit_warnings():
        model = torch.jit.load(str(path), map_location="cpu").eval()
    with torch.no_grad():
        return model(images)


def run_safetensors(path: Path, classifier: Classifier, images: torch.Tensor) -> torch.Tensor:
    """Loads the weights into a freshly built model, as a user of the file would."""
    from safetensors.torch import load_file

    model = build_model(classifier.model_name, len(classifier.class_names))
    model.load_state_dict(load_file(str(path)))
    with torch.no_grad():
        return model.eval()(images)


@dataclass(frozen=True)
class ExportFormat:
    write: Callable[[nn.Module, torch.Tensor], bytes]
    run: Callable[[Path, Classifier, torch.Tensor], torch.Tensor]


FORMATS = {
    "onnx": ExportFormat(onnx_bytes, run_onnx),
    "torchscript": ExportFormat(torchscript_bytes, run_torchscript),
    "safetensors": ExportFormat(safetensors_bytes, run_safetensors),
}


# ----------------------------------------------------------------------------- the check


def compare_outputs(
    exported: torch.Tensor, reference: torch.Tensor, atol: float, rtol: float
) -> dict[str, Any]:
    """How far the exported model's logits are from PyTorch's; raises ``CheckFailed`` when any
    differs by more than atol + rtol x |reference| (torch.allclose's rule)."""
    exported, reference = exported.double(), reference.double()
    if exported.shape != reference.shape:
        raise CheckFailed(
            f"the exported model's output has shape {tuple(exported.shape)}, PyTorch's "
            f"{tuple(reference.shape)}"
        )
    difference = (exported - reference).abs()
    result = {
        "max_abs_diff": float(difference.max()),
        "same_top1": int((exported.argmax(1) == reference.argmax(1)).sum()),
        "images": int(reference.shape[0]),
        "atol": atol,
        "rtol": rtol,
    }
    if not torch.all(difference <= atol + rtol * reference.abs()):
        raise CheckFailed(
            f"the exported model's logits differ from the checkpoint's by up to "
            f"{result['max_abs_diff']:.3g} (tolerance: {atol:g} + {rtol:g} x |logit|; "
            f"{result['same_top1']}/{result['images']} top-1 predictions agree)"
        )
    return result


def preprocessing(classifier: Classifier, fmt: str, output: Path, checkpoint: Path) -> dict:
    """What a deployment needs to feed the exported model as training's evaluation did."""
    size = classifier.image_size
    return {
        "format": fmt,
        "file": output.name,
        "checkpoint": str(checkpoint),
        "weights": classifier.weights,
        "model_name": classifier.model_name,
        "class_names": classifier.class_names,
        "image_size": size,
        "eval_resize_ratio": classifier.eval_resize_ratio,
        "resize_side": eval_resize_side(size, classifier.eval_resize_ratio),
        "mean": list(classifier.mean),
        "std": list(classifier.std),
        "steps": [
            "decode as RGB",
            "resize the short side to resize_side (bilinear, antialiased)",
            "crop the centre image_size x image_size",
            "scale to [0, 1] (divide by 255), subtract mean, divide by std (per channel)",
        ],
        "input": {"name": INPUT_NAME, "shape": ["batch", 3, size, size], "dtype": "float32"},
        "output": {
            "name": OUTPUT_NAME,
            "shape": ["batch", len(classifier.class_names)],
            "meaning": "logits in class_names order; softmax gives the probabilities",
        },
    }


def export_failed(fmt: str, model_name: str, stage: str, err: Exception) -> str:
    """The one line for a model the ``fmt`` exporter (or its runtime, at ``stage`` "run")
    cannot handle: the first line of the error it was raised from (torch.onnx wraps the reason
    in a generic "Failed to export" error) and the other formats to try."""
    while err.__cause__ is not None:
        err = err.__cause__  # type: ignore[assignment]
    reason = first_line(err, text=re.sub(r"\x1b\[[0-9;]*m", "", str(err)))  # no terminal colours
    if stage == "export":
        what = f"the {fmt} exporter cannot handle the model {model_name}"
    else:
        what = f"the {fmt} file exported from the model {model_name} does not run"
    others = " or ".join(f"--format {other}" for other in SUFFIXES if other != fmt)
    return f"--format {fmt}: {what} ({reason}); nothing written; try {others}"


def export(args: argparse.Namespace) -> tuple[Path, dict[str, Any], str]:
    """Write the exported model and its JSON, once the check passed; returns the model's path,
    the check's figures and where its images came from."""
    require_packages(args.format)
    cpu = torch.device("cpu")
    classifier = load_classifier(args.checkpoint, cpu, args.weights)
    folder = args.check_images or default_check_folder(classifier.config)
    images, source = check_inputs(classifier, folder, args.check_count)
    with torch.no_grad():
        reference = classifier.model(images)
    output = args.output
    fmt = FORMATS[args.format]
    # Two examples: a batch of one would make the ONNX exporter fix the batch size at 1.
    try:
        data = fmt.write(classifier.model, images[[0, len(images) - 1]])
    except Exception as err:  # each exporter has its own errors for what it cannot handle
        raise UserError(export_failed(args.format, classifier.model_name, "export", err)) from None
    # Written under a temporary name and checked there: a model that fails the check is never
    # left where a deployment would pick it up.
    pending = output.with_name(f".{output.name}.pending")
    try:
        atomic_write(pending, lambda f: f.write(data), lambda: len(data))
        try:
            outputs = fmt.run(pending, classifier, images)
        except Exception as err:  # a runtime that cannot load or run what the exporter wrote
            raise UserError(export_failed(args.format, classifier.model_name, "run", err)) from None
        result = compare_outputs(outputs, reference, args.atol, args.rtol)
        result["images_from"] = source
        info = {**preprocessing(classifier, args.format, output, args.checkpoint), "check": result}
        text = (json.dumps(info, indent=2) + "\n").encode()
        atomic_write(preprocessing_path(output), lambda f: f.write(text), lambda: len(text))
        os.replace(pending, output)
    finally:
        pending.unlink(missing_ok=True)
    return output, result, source


@exit_on_user_error
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        output, result, source = export(args)
    except CheckFailed as err:
        print(
            f"error: export check failed on {args.format}: {err}; nothing written", file=sys.stderr
        )
        return EXIT_CHECK_FAILED
    print(
        f"Wrote {output} and {preprocessing_path(output)}; checked on {source}: logits within "
        f"{result['max_abs_diff']:.2g} of the checkpoint's (tolerance {args.atol:g} + "
        f"{args.rtol:g} x |logit|), {result['same_top1']}/{result['images']} top-1 predictions agree"
    )
    return 0

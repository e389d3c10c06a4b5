"""A trained classifier loaded from its checkpoint alone, for src/evaluate.py and src/predict.py.

The model, its class names and the preprocessing it was trained with. With --model_ema,
``--weights auto`` takes the weights behind the checkpoint's best_acc.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchvision.transforms import v2

from imgtrainer.checkpoints.files import INFERENCE_KEYS, CheckpointError, load_checkpoint_file
from imgtrainer.config import add_device_argument, check_bound
from imgtrainer.data import IMAGENET_MEAN, IMAGENET_STD
from imgtrainer.data.host.transforms import EVAL_RESIZE_RATIO, eval_transforms
from imgtrainer.errors import message_line
from imgtrainer.models import build_model, strip_wrapper_prefixes
from imgtrainer.precision import Precision, precision_rule
from imgtrainer.reports.history import checked_history
from imgtrainer.training.memory import MemoryPlan


@dataclass(frozen=True)
class Classifier:
    model: nn.Module  # in eval mode, on the requested device
    class_names: list[str]  # index -> name, the order of the model's outputs
    image_size: int
    transform: v2.Compose  # the evaluation geometry of training (resize, center crop)
    mean: tuple[float, ...]  # normalisation, applied per batch (data.normalize_batch)
    std: tuple[float, ...]
    # How training ran its evaluation pass (autocast, micro-batch, layout), so the tools'
    # predictions are the ones behind the recorded val_acc.
    precision: Precision = Precision(False, torch.float32)
    plan: MemoryPlan = field(default_factory=MemoryPlan)
    eval_resize_ratio: float = EVAL_RESIZE_RATIO  # short side resized to image_size / this
    tta: str = "none"  # test-time augmentation: none, or flip (``FlipAveraged``)
    weights: str = "raw"  # which of the checkpoint's weights: "raw" or "ema"
    weights_note: str = "the trained weights"  # which, and why, for the tools' output
    model_name: str = ""  # the timm model name (export.py rebuilds the model from it)
    config: dict[str, Any] = field(default_factory=dict)  # the training run's flags
    # The training run's epoch records and best epoch, as its history file holds them.
    history: dict[str, Any] | None = None
    path: Path | None = None  # the checkpoint file


TTA_CHOICES = ("none", "flip")


class FlipAveraged(nn.Module):
    """Flip test-time augmentation: the average of the softmax of an image and of its mirror
    image, returned as log-probabilities. Softmax, not logits, is averaged (as timm's and
    torchvision's references do): each view votes with its confidence. Log-probabilities are
    logits whose softmax is that average, so the loss, top-k and confidence computed from the
    output (``training.evaluation.evaluation_sums``, ``predict.py``) need no change."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        views = torch.stack(
            [
                self.model(images).float().log_softmax(dim=1),
                self.model(images.flip(-1)).float().log_softmax(dim=1),
            ]
        )
        # log((p + q) / 2) without leaving log space: no underflow to log(0).
        return views.logsumexp(dim=0) - math.log(2)


WEIGHTS_CHOICES = ("auto", "ema", "raw")


def choose_weights(
    state: dict[str, Any], path: Path, requested: str = "auto"
) -> tuple[str, dict[str, torch.Tensor], str]:
    """("ema" or "raw", that state dict, a note saying which and why) for ``--weights``."""
    ema = state.get("model_ema_state_dict")
    if requested == "ema" and ema is None:
        raise CheckpointError(
            f"--weights ema: {path} holds no EMA weights (trained without --model_ema); "
            "use --weights raw or auto"
        )
    if requested == "raw":
        return "raw", state["model_state_dict"], "the raw weights (--weights raw)"
    if requested == "ema":
        return "ema", ema, "the EMA weights (--weights ema)"
    if ema is None:
        return "raw", state["model_state_dict"], "the trained weights (the checkpoint has no EMA)"
    if state.get("best_weights") == "raw":  # checkpoint_best.pth: the weights that scored best
        metric = state.get("best_metric", "val_acc")  # --best_metric of the run
        better = "a lower" if "loss" in metric else "a higher"
        note = f"the raw weights (they scored {better} {metric} than the EMA weights; "
        return "raw", state["model_state_dict"], note + "--weights ema for those)"
    return "ema", ema, "the EMA weights (--weights raw for the trained ones)"


def load_classifier(
    path: Path,
    device: torch.device,
    weights: str = "auto",
    eval_resize_ratio: float | None = None,
    tta: str = "none",
) -> Classifier:
    """The checkpoint's model ready for inference, with the weights ``weights`` picks
    (``choose_weights``), or one clear error (exit code 2). ``eval_resize_ratio`` None: the one
    training validated with (0.875 for a checkpoint from before --eval_resize_ratio)."""
    state = load_checkpoint_file(path)  # weights_only=True: a file that runs code is refused
    check_inference_checkpoint(state, path)
    class_names = list(state["class_names"])
    model = build_model(state["model_name"], len(class_names))
    chosen, state_dict, note = choose_weights(state, path, weights)
    try:
        model.load_state_dict(strip_wrapper_prefixes(state_dict))
    except RuntimeError as err:
        raise CheckpointError(
            f"the weights in {path} do not fit {state['model_name']} with "
            f"{len(class_names)} classes ({message_line(str(err))})"
        ) from None
    image_size = int(state["image_size"])
    config = state.get("config") or {}
    plan = MemoryPlan(
        micro_batch=state.get("micro_batch"),
        channels_last=bool(config.get("channels_last")) and device.type == "cuda",
    )
    if plan.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if eval_resize_ratio is None:
        eval_resize_ratio = float(config.get("eval_resize_ratio", EVAL_RESIZE_RATIO))
    if tta == "flip":
        model = FlipAveraged(model)
    return Classifier(
        model.to(device).eval(),
        class_names,
        image_size,
        eval_transforms(image_size, eval_resize_ratio),
        tuple(state.get("mean", IMAGENET_MEAN)),
        tuple(state.get("std", IMAGENET_STD)),
        training_precision(config, device),
        plan,
        eval_resize_ratio,
        tta,
        chosen,
        note,
        state["model_name"],
        config,
        checkpoint_history(state),
        path,
    )


def checkpoint_history(state: dict[str, Any]) -> dict[str, Any] | None:
    """The training history a checkpoint carries, in the history file's form (for the report's
    curves); None for a checkpoint without one, or with one of another shape."""
    if not state.get("history"):
        return None
    best = {"epoch": state.get("best_epoch"), "metric": state.get("best_metric")}
    history = {
        "config": state.get("config") or {},
        "epochs": list(state["history"]) if isinstance(state["history"], list) else None,
        "best": {**best, "weights": state.get("best_weights")},
    }
    try:
        return checked_history(history)
    except ValueError:  # a history of another shape: the report without its curves
        return None


def training_precision(config: dict[str, Any], device: torch.device) -> Precision:
    """The autocast training used on this device type, from the checkpoint's config; float32
    for a file without one."""
    return precision_rule(
        bool(config.get("use_amp")),
        bool(config.get("low_memory")),
        config.get("amp_dtype", "float16"),
        device,
    )


def add_inference_arguments(
    parser: argparse.ArgumentParser,
    batch_size: int,
    batch_size_help: str,
    num_workers_help: str,
) -> None:
    """The flags src/evaluate.py and src/predict.py share, with the same meaning."""
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="checkpoint written by src/train_ddp.py",
    )
    add_device_argument(parser)
    parser.add_argument(
        "--batch_size",
        type=int,
        default=batch_size,
        help=f"{batch_size_help} (default: {batch_size})",
    )
    parser.add_argument("--num_workers", type=int, default=None, help=num_workers_help)
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="auto",
        help="which weights of a checkpoint trained with --model_ema: ema (the moving "
        "average), raw (the trained ones), or auto: ema unless the checkpoint says the raw "
        "ones scored better on the run's --best_metric (default: auto)",
    )
    parser.add_argument(
        "--eval_resize_ratio",
        type=float,
        default=None,
        help="resize the short side to image_size / R, then centre-crop image_size "
        "(default: the value training validated with, stored in the checkpoint)",
    )
    parser.add_argument(
        "--tta",
        choices=TTA_CHOICES,
        default="none",
        help="test-time augmentation: flip averages the softmax of each image and its "
        "horizontal mirror (two forward passes; default: none)",
    )


def check_inference_arguments(args: argparse.Namespace) -> None:
    """One error line (exit code 2) for a shared flag out of range: the training flag's bounds."""
    for flag in ("batch_size", "num_workers", "eval_resize_ratio"):
        check_bound(flag, getattr(args, flag))


def check_inference_checkpoint(state: dict[str, Any], path: Path) -> None:
    missing = [key for key in INFERENCE_KEYS if key not in state]
    if missing:
        raise CheckpointError(
            f"{path} is not a checkpoint of src/train_ddp.py: it has no {', '.join(missing)} "
            "(a bare state dict or another tool's file?); use checkpoint_best.pth or "
            "checkpoint_latest.pth from a training run"
        )
    names = state["class_names"]
    if (
        not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(name, str) for name in names)
    ):
        raise CheckpointError(f"{path}: class_names must be a non-empty list of strings")

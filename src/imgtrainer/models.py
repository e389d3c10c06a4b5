"""Building the model with timm, loading local weights, and unwrapping DDP / compiled models."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import timm
import torch
from torch import nn

from imgtrainer import torch_compat
from imgtrainer.errors import UserError

log = logging.getLogger(__name__)


MODEL_HUB_HOST = "huggingface.co"


def build_model(
    name: str, num_classes: int, pretrained: bool = False, pretrained_path: str | None = None
) -> nn.Module:
    """``timm.create_model(name, num_classes=...)``, from hub or local weights if asked."""
    check_model_source(name, pretrained)
    model = timm.create_model(name, num_classes=num_classes, pretrained=pretrained)
    if pretrained_path:
        load_pretrained_weights(model, Path(pretrained_path))
    return model


def check_model_source(name: str, pretrained: bool) -> None:
    """A timm model name, and for ``pretrained`` a reachable model hub; else one clear error."""
    if not timm.is_model(name):
        raise UserError(
            f"--model {name} is not a timm model name; see timm.list_models() for the choices"
        )
    if pretrained:
        _require_model_hub(name)


def _require_model_hub(name: str) -> None:
    """Fail fast (instead of minutes of download retries) when the model hub is unreachable."""
    try:
        socket.create_connection((MODEL_HUB_HOST, 443), timeout=3).close()
    except OSError:
        raise UserError(
            f"--pretrained needs to download {name} weights from {MODEL_HUB_HOST}, "
            "which cannot be reached; download the weights on a machine with network "
            "access and pass --pretrained_path FILE instead"
        ) from None


def load_pretrained_weights(model: nn.Module, path: Path) -> None:
    """Load a local timm/torchvision state dict, keeping our own (freshly initialised) head."""
    from imgtrainer.checkpoints.files import load_checkpoint_file

    raw = load_checkpoint_file(path)
    state = raw.get("model_state_dict", raw.get("state_dict", raw))
    state = strip_wrapper_prefixes(state)
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    head_keys = {f"{_module_name(model, head)}.{k}" for k in head.state_dict()} if head else set()
    backbone = {k: v for k, v in state.items() if k not in head_keys}
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    missing = [k for k in missing if k not in head_keys]
    if missing or unexpected:
        raise UserError(
            f"--pretrained_path {path} does not fit --model: "
            f"{len(missing)} missing keys (e.g. {missing[:3]}), "
            f"{len(unexpected)} unexpected keys (e.g. {unexpected[:3]})"
        )
    log.info(f"Loaded pretrained weights from {path} (classifier head re-initialised)")


def _module_name(root: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in root.named_modules() if module is target)


WRAPPER_PREFIXES = ("module.", f"{torch_compat.COMPILED_MODULE_ATTR}.")  # DDP, torch.compile


def strip_wrapper_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes from the start
    of keys, however nested (``_orig_mod.module.``). Only from the start: a model's own
    submodule may be called ``module`` or end in it (``...submodule.weight``)."""

    def clean(key: str) -> str:
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        return key

    return {clean(k): v for k, v in state.items()}


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DDP and/or torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif torch_compat.compiled_original(model) is not model:
            model = torch_compat.compiled_original(model)
        else:
            return model

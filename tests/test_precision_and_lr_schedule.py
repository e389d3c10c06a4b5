"""The AMP path on the CPU (bfloat16 autocast), the CUDA float16 + GradScaler path where a GPU
exists, and the learning-rate schedule."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from imgtrainer.config import parse_config
from imgtrainer.precision import Precision, choose_precision
from imgtrainer.training.evaluation import EvalSettings, evaluate
from imgtrainer.training.loop import train_one_epoch
from imgtrainer.training.memory import MemoryPlan
from imgtrainer.training.optim import lr_factor
from imgtrainer.training.step import RunParts


def tiny_batches(n: int = 4, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(8, 3, 16, 16, generator=g).to(device),
            torch.randint(0, 3, (8,), generator=g).to(device),
        )
        for _ in range(n)
    ]


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
    )


def run_epoch(
    precision: Precision, device: str = "cpu", model: nn.Module | None = None
) -> tuple[dict, nn.Module]:
    model = (model or tiny_model()).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = torch.amp.GradScaler(device, enabled=precision.dtype == torch.float16)
    state = RunParts(
        model,
        optimizer,
        scheduler,
        scaler,
        nn.CrossEntropyLoss(),
        precision,
        MemoryPlan(),
        torch.device(device),
    )
    metrics = train_one_epoch(state, tiny_batches(device=device))
    return metrics, model


def test_cpu_amp_uses_bfloat16_autocast_and_warns(caplog):
    cfg = parse_config(["--use_amp"])
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        precision = choose_precision(cfg, torch.device("cpu"))
    assert precision == Precision(True, torch.bfloat16)
    assert "slower" in caplog.text
    assert choose_precision(parse_config([]), torch.device("cpu")).enabled is False


def test_cpu_amp_trains_and_evaluates_with_the_forward_in_bfloat16():
    """The step's and evaluation's own forwards run under autocast: a hook on the first layer,
    registered before they are called, sees bfloat16 outputs at every training and evaluation
    step."""
    model, seen = tiny_model(), []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    bf16 = Precision(True, torch.bfloat16)
    metrics, model = run_epoch(bf16, model=model)
    assert seen == [torch.bfloat16] * 4  # one forward per step
    assert metrics["train_samples"] == 32 and metrics["steps"] == 4
    assert math.isfinite(metrics["train_loss"])
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    seen.clear()
    val = evaluate(model, tiny_batches(2), EvalSettings(torch.device("cpu"), bf16, None, False))
    assert seen == [torch.bfloat16] * 2 and val["val_samples"] == 16
    # And without AMP the same forwards stay in float32: the hook does tell them apart.
    seen.clear()
    run_epoch(Precision(False, torch.float32), model=model)
    assert seen == [torch.float32] * 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float16_with_grad_scaler():
    cfg = parse_config(["--use_amp"])
    precision = choose_precision(cfg, torch.device("cuda"))
    assert precision == Precision(True, torch.float16)
    metrics, _ = run_epoch(precision, device="cuda")
    assert math.isfinite(metrics["train_loss"]) and metrics["steps"] == 4


def test_lr_schedule_warmup_then_cosine_and_step():
    cosine = dict(kind="cosine", warmup_steps=10, total_steps=110, decay_every=50, gamma=0.1)
    assert lr_factor(0, **cosine) == pytest.approx(0.1)
    assert lr_factor(9, **cosine) == pytest.approx(1.0)
    assert lr_factor(60, **cosine) == pytest.approx(0.5)
    assert lr_factor(110, **cosine) == pytest.approx(0.0)
    step = {**cosine, "kind": "step", "warmup_steps": 0}
    assert [lr_factor(s, **step) for s in (0, 49, 50, 100)] == pytest.approx([1, 1, 0.1, 0.01])
    assert lr_factor(77, **{**cosine, "kind": "none"}) == 1.0


def test_lr_scaling_by_world_size():
    from imgtrainer.training.optim import build_optimizer

    model = tiny_model()
    for scaling, expected in (("none", 0.01), ("linear", 0.04), ("sqrt", 0.02)):
        cfg = parse_config(["--learning_rate", "0.01", "--lr_scaling", scaling])
        assert build_optimizer(cfg, model, world_size=4).param_groups[0]["lr"] == pytest.approx(
            expected
        )

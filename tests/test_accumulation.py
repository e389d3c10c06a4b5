"""--accum_steps K in the usual sense: K batches of --batch_size per optimizer step per process.

The loader yields the K batches as one (K x batch_size images), the step runs them as K
forward/backward passes and exchanges gradients once; effective batch = batch x K x processes.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import imgtrainer.run.train as train_ddp
from conftest import CPU, FP32, TINY_FLAGS, cpu_run_parts, run_train, user_error_line
from imgtrainer.checkpoints.resume import changed_settings, check_resume_settings, saved_step_batch
from imgtrainer.config import Layout, TrainConfig, optimizer_batch, parse_config
from imgtrainer.data.checks import check_batch_fits
from imgtrainer.errors import UserError
from imgtrainer.training.loop import train_one_epoch
from imgtrainer.training.memory import MemoryPlan
from imgtrainer.training.memory_fit import TrialParts, build_memory_plan
from imgtrainer.training.optim import build_optimizer, lr_scale


def tiny_net() -> nn.Module:
    """No BatchNorm: splitting a batch into passes cannot change its gradient."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 4),
    )


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def step_batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the trainer's loader yields: one batch of ``size`` images per optimizer step."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 3, 10, 10, generator=g), torch.randint(0, 4, (size,), generator=g))
        for _ in range(steps)
    ]


def count_forwards(model: nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def train_with_the_loop(model: nn.Module, loader, plan: MemoryPlan, optimizer: str) -> dict:
    """The real epoch and step functions, as the trainer calls them."""
    opt = make_optimizer(model, optimizer)
    return train_one_epoch(cpu_run_parts(model, opt, plan), loader)


def train_textbook(model: nn.Module, loader, batch: int, optimizer: str) -> None:
    """Gradient accumulation as the tutorials write it: K batches, loss / K, one step."""
    opt, criterion = make_optimizer(model, optimizer), nn.CrossEntropyLoss()
    for images, targets in loader:
        opt.zero_grad()
        chunks = list(zip(images.split(batch), targets.split(batch), strict=True))
        for x, y in chunks:
            (criterion(model(x), y) / len(chunks)).backward()
        opt.step()


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_k_batches_of_b_step_like_one_batch_of_k_times_b(optimizer):
    k, b, steps = 4, 8, 3
    loader = step_batches(steps, k * b)
    accumulated, whole, textbook = tiny_net(), tiny_net(), tiny_net()
    passes, single = count_forwards(accumulated), count_forwards(whole)

    # How the trainer runs --batch_size 8 --accum_steps 4: micro-batch = batch_size.
    got = train_with_the_loop(accumulated, loader, MemoryPlan(b), optimizer)
    ref = train_with_the_loop(whole, loader, MemoryPlan(None), optimizer)
    train_textbook(textbook, loader, b, optimizer)

    assert (passes[0], single[0]) == (k * steps, steps)  # K passes per step vs one
    assert (got["steps"], got["train_samples"]) == (ref["steps"], ref["train_samples"])
    assert got["train_samples"] == k * b * steps
    assert got["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-6)
    for name, p in accumulated.named_parameters():
        q, r = dict(whole.named_parameters())[name], dict(textbook.named_parameters())[name]
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} vs one batch")
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=f"{name} vs textbook")
    start = tiny_net().parameters()
    moved = max((p - q).abs().max().item() for p, q in zip(start, whole.parameters(), strict=True))
    assert moved > 1e-3  # the steps did change the weights


def test_the_trainer_plans_one_pass_per_batch(caplog):
    """--batch_size 8 --accum_steps 4: each loaded step of 32 images is 4 passes of 8. The
    batch size need not be divisible by --accum_steps any more."""
    model = tiny_net()
    opt = make_optimizer(model, "sgd")
    with caplog.at_level(logging.INFO, logger="imgtrainer"):
        for flags, micro, step in (
            (["--batch_size", "8", "--accum_steps", "4"], 8, 32),
            (["--batch_size", "30", "--accum_steps", "4"], 30, 120),
            (["--batch_size", "8"], 8, 8),
        ):
            cfg = parse_config(["--image_size", "10", *flags])
            trial = TrialParts(model, opt, nn.CrossEntropyLoss(), FP32, CPU)
            plan = build_memory_plan(cfg, trial, 1, 4)
            assert (plan.micro_batch, optimizer_batch(cfg)) == (micro, step)
            assert f"micro-batch {micro} ({step // micro} forward/backward pass(es) " in caplog.text
            assert f"per optimizer step of {step} images per process" in caplog.text


class OutOfMemoryAbove(nn.Module):
    """Raises torch.OutOfMemoryError (what CUDA raises) for passes of more than ``limit``."""

    def __init__(self, model: nn.Module, limit: int):
        super().__init__()
        self.model, self.limit = model, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.model(x)


def test_fitting_starts_at_batch_size_and_keeps_a_divisor_of_the_step():
    """--low_memory / --auto_micro_batch: from --batch_size 30 down, each size dividing the
    step's 120 images (30, 15, 6, ...), never above --batch_size."""
    model = OutOfMemoryAbove(tiny_net(), limit=20)
    opt = make_optimizer(model, "sgd")
    cfg = parse_config(
        ["--image_size", "10", "--batch_size", "30", "--accum_steps", "4", "--auto_micro_batch"]
    )
    plan = build_memory_plan(cfg, TrialParts(model, opt, nn.CrossEntropyLoss(), FP32, CPU), 1, 4)
    assert plan.micro_batch == 15 and plan.retry_on_oom
    roomy = OutOfMemoryAbove(tiny_net(), limit=1000)
    trial = TrialParts(roomy, make_optimizer(roomy, "sgd"), nn.CrossEntropyLoss(), FP32, CPU)
    plan = build_memory_plan(cfg, trial, 1, 4)
    assert plan.micro_batch == 30  # the batch the user asked for, not the step's 120


# ----------------------------------------------------------------------------- arithmetic


def test_effective_batch_and_its_line():
    cfg = parse_config(["--batch_size", "32", "--accum_steps", "4"])
    assert (optimizer_batch(cfg), Layout.of(cfg, 2).global_batch) == (128, 256)
    assert Layout.of(cfg, 2).describe() == (
        "--batch_size 32 x --accum_steps 4 x 2 process(es) = 256"
    )
    assert Layout.of(cfg, 2).short() == "32x4x2=256"
    with pytest.raises(UserError, match="--accum_steps must be at least 1, got 0"):
        parse_config(["--accum_steps", "0"])


def test_lr_scaling_by_accum_steps_times_world_size():
    assert lr_scale("none", 4, 2) == 1.0
    assert lr_scale("linear", 4, 2) == 8.0
    assert lr_scale("sqrt", 4, 2) == pytest.approx(math.sqrt(8))
    assert lr_scale("linear", 1, 3) == 3.0  # without accumulation: the world size alone
    model = tiny_net()
    for scaling, expected in (("none", 0.01), ("linear", 0.08), ("sqrt", 0.01 * math.sqrt(8))):
        cfg = parse_config(
            ["--learning_rate", "0.01", "--lr_scaling", scaling, "--accum_steps", "4"]
        )
        lr = build_optimizer(cfg, model, world_size=2).param_groups[0]["lr"]
        assert lr == pytest.approx(expected)


def test_too_few_images_counts_the_optimizer_batch():
    cfg = parse_config(["--train_dir", "t", "--batch_size", "16", "--accum_steps", "3"])
    check_batch_fits(48, cfg, 1)  # exactly one step of 48
    with pytest.raises(UserError, match=r"--batch_size 16 x --accum_steps 3 = 48 images on 2"):
        check_batch_fits(48, cfg, 2)  # 24 per process


# ----------------------------------------------------------------------------- resume checks


def checkpoint_like(batch: int, accum: int, processes: int, new_style: bool) -> dict:
    config = dict(TrainConfig().to_dict(), learning_rate=0.01, batch_size=batch, accum_steps=accum)
    state = {"config": config, "world_size": processes}
    if new_style:
        state["effective_batch_size"] = batch * accum * processes
    return state


def test_resume_compares_the_effective_batch():
    state = checkpoint_like(8, 2, 2, new_style=True)  # 32 images per step
    same = dict(state["config"])
    assert saved_step_batch(state) == (8, 2)
    assert changed_settings(state, same, 2) == []
    assert changed_settings(state, dict(same, batch_size=16, accum_steps=1), 2) == []
    assert changed_settings(state, dict(same, accum_steps=4), 1) == []  # 8x4x1 = 32
    assert changed_settings(state, dict(same, accum_steps=4), 2) == [
        "effective batch per optimizer step (--batch_size x --accum_steps x processes) "
        "8x2x2=32 -> 8x4x2=64"
    ]
    # The same flags on another number of processes keep the global batch (the layout
    # changes); per-process flags that change it are refused.
    assert check_resume_settings(state, Path("c.pth"), same, 1, override=False) == []
    with pytest.raises(UserError, match="8x2x2=32 -> 8x1x1=8.*--resume_override"):
        check_resume_settings(state, Path("c.pth"), dict(same, accum_steps=1), 1, override=False)
    # --global_batch_size states it: the same one is no change, another one is.
    assert changed_settings(state, dict(same, global_batch_size=32, accum_steps=7), 3) == []
    assert changed_settings(state, dict(same, global_batch_size=64), 2) == [
        "effective batch per optimizer step (--batch_size x --accum_steps x processes) "
        "8x2x2=32 -> --global_batch_size 64"
    ]


def test_an_old_checkpoint_meant_batch_size_per_step():
    """Before, --batch_size 16 --accum_steps 4 was 16 images per step (4 passes of 4): the same
    step is --batch_size 4 --accum_steps 4 now."""
    state = checkpoint_like(16, 4, 1, new_style=False)
    assert saved_step_batch(state) == (16, 1)
    assert changed_settings(state, dict(state["config"], batch_size=4), 1) == []
    assert changed_settings(state, dict(state["config"], accum_steps=1), 1) == []
    [change] = changed_settings(state, state["config"], 1)  # the same flags: 64 now
    assert "16x1x1=16 -> 16x4x1=64" in change
    assert "--batch_size 16 --accum_steps 4 was 16 images per step" in change
    assert "which --batch_size 4 --accum_steps 4 gives now" in change
    # Without accumulation both meanings agree.
    old_plain = checkpoint_like(8, 1, 2, new_style=False)
    assert changed_settings(old_plain, old_plain["config"], 2) == []


# ----------------------------------------------------------------------------- real runs


def flags_for(train: Path, val: Path, *extra: str) -> list[str]:
    return ["--train_dir", str(train), "--val_dir", str(val), *TINY_FLAGS, *extra]


@pytest.mark.slow
def test_effective_batch_in_checkpoint_history_and_log(tiny_dataset, tmp_path: Path, capsys):
    """48 images, --batch_size 4 --accum_steps 2: 6 optimizer steps of 8 images per epoch."""
    train, val = tiny_dataset
    flags = flags_for(train, val, "--batch_size", "4", "--accum_steps", "2")
    assert run_train([*flags, "--epochs", "1"], cwd=tmp_path) == 0
    ckpt = torch.load(tmp_path / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    assert ckpt["effective_batch_size"] == 8 and ckpt["micro_batch"] == 4
    assert ckpt["scheduler_state_dict"]["last_epoch"] == 6  # optimizer steps, not passes
    history = json.loads((tmp_path / "logs" / "training_history.json").read_text())
    assert history["effective_batch_size"] == 8 and history["config"]["accum_steps"] == 2
    assert history["epochs"][0]["micro_batch"] == 4
    log = (tmp_path / "logs" / "train_rank_0.log").read_text()
    assert (
        "Effective batch: --batch_size 4 x --accum_steps 2 x 1 process(es) = 8 images per "
        "optimizer step"
    ) in log

    # A resume that changes the effective batch is refused; one that keeps it continues.
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", *flags, "--batch_size", "8", "--epochs", "2", "--resume", "auto"],
        capsys,
        cwd=tmp_path,
    )
    assert "4x2x1=8 -> 8x2x1=16" in line
    same = [*flags, "--batch_size", "8", "--accum_steps", "1", "--epochs", "2", "--resume", "auto"]
    assert run_train(same, cwd=tmp_path) == 0
    ckpt = torch.load(tmp_path / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    assert (ckpt["epoch"], ckpt["effective_batch_size"]) == (2, 8)


@pytest.mark.slow
def test_an_old_style_checkpoint_resumes_mid_epoch(trained_run, tmp_path: Path, capsys):
    """A checkpoint from before the change, written with --batch_size 8 --accum_steps 2 (8
    images per step, in passes of 4), stopped after step 3 of epoch 2: --batch_size 4
    --accum_steps 2 continues it at the same position; the same flags as then are refused."""
    workdir = trained_run.copy_to(tmp_path)
    latest = workdir / "checkpoints" / "checkpoint_latest.pth"
    ckpt = torch.load(latest, weights_only=True)
    for key in ("effective_batch_size", "epoch_position", "layout"):  # keys added since
        del ckpt[key]
    ckpt.update(format_version=1, epoch=1, step=3, micro_batch=4, history=ckpt["history"][:1])
    ckpt["config"] = dict(ckpt["config"], batch_size=8, accum_steps=2)
    torch.save(ckpt, latest)
    flags = [*trained_run.flags, "--epochs", "2", "--resume", str(latest)]

    line = user_error_line(
        train_ddp.main, ["--device", "cpu", *flags, "--accum_steps", "2"], capsys, cwd=workdir
    )
    assert "8x1x1=8 -> 8x2x1=16" in line and "--batch_size 4 --accum_steps 2 gives now" in line

    assert run_train([*flags, "--batch_size", "4", "--accum_steps", "2"], cwd=workdir) == 0
    log = (workdir / "logs" / "train_rank_0.log").read_text()
    assert "epoch 2, step 3 of 6" in log and "restarts from its first step" not in log
    resumed = torch.load(latest, weights_only=True)
    assert (resumed["epoch"], resumed["effective_batch_size"]) == (2, 8)

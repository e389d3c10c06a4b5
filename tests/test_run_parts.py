"""The shape of a run (issue 11): one builder for its parts, the loop's hook points, DDP's
private internals checked in one place, and the checkpoint schema with its format version."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import imgtrainer.run.train as train_ddp
from conftest import CPU, run_train, user_error_line
from imgtrainer.checkpoints.files import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_SCHEMA,
    load_checkpoint_file,
    training_checkpoint,
)
from imgtrainer.config import parse_config
from imgtrainer.distributed.setup import DistInfo
from imgtrainer.hooks import Hook
from imgtrainer.precision import Precision, make_grad_scaler
from imgtrainer.torch_compat import check_ddp_internals, reset_ddp_after_failed_attempt
from imgtrainer.training.build import build_run_parts
from imgtrainer.training.loop import EpochPlan, train_one_epoch
from imgtrainer.training.memory import MemoryPlan
from imgtrainer.training.step import RunParts

ONE_PROCESS = DistInfo(0, 0, 1, 1, CPU)


def batches(n: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(size, 3, 8, 8, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(n)
    ]


def tiny_state(scaler: torch.amp.GradScaler | None = None) -> RunParts:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return RunParts(
        model,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        scaler or torch.amp.GradScaler("cpu", enabled=False),
        nn.CrossEntropyLoss(),
        Precision(False, torch.float32),
        MemoryPlan(),
        CPU,
    )


# ----------------------------------------------------------------------------- the builder


def test_the_builder_takes_every_part_from_the_config():
    cfg = parse_config(
        [
            "--model",
            "resnet18",
            "--label_smoothing",
            "0.2",
            "--optimizer",
            "adamw",
            "--learning_rate",
            "0.003",
        ]
    )
    parts = build_run_parts(cfg, ONE_PROCESS, num_classes=5, steps_per_epoch=4)
    assert parts.criterion.label_smoothing == 0.2  # for the trainer and the benchmarks alike
    assert isinstance(parts.optimizer, torch.optim.AdamW)
    assert parts.optimizer.param_groups[0]["lr"] == pytest.approx(0.003)
    assert parts.plain_model is parts.model  # one process, no compile: nothing wraps it
    assert parts.model.get_classifier().out_features == 5
    assert not parts.scaler.is_enabled() and not parts.precision.enabled
    # Two builds from one config give the same initial weights (every rank must).
    again = build_run_parts(cfg, ONE_PROCESS, num_classes=5, steps_per_epoch=4)
    for p, q in zip(parts.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_loss_scaling_only_for_float16():
    assert make_grad_scaler(Precision(True, torch.float16), CPU).is_enabled()
    assert not make_grad_scaler(Precision(True, torch.bfloat16), CPU).is_enabled()
    assert not make_grad_scaler(Precision(False, torch.float32), CPU).is_enabled()


# ----------------------------------------------------------------------------- hook points


class Recorder(Hook):
    def __init__(self, stop_at: int | None = None, enabled: bool = True):
        self.steps, self.logs, self.stop_at, self.enabled = [], [], stop_at, enabled

    def on_step_end(self, info) -> bool:
        self.steps.append((info.step, info.global_step, info.taken, info.sums[2].item()))
        return info.step == self.stop_at

    def on_log_step(self, global_step: int, metrics: dict) -> None:
        self.logs.append((global_step, metrics))


def test_hooks_see_every_step_and_the_logging_steps_with_floats():
    hook = Recorder()
    metrics = train_one_epoch(
        tiny_state(),
        batches(5),
        hooks=[hook],
        epoch=EpochPlan(start_step=2, first_global_step=12, log_interval=2),
    )
    # The loader already skips the 2 steps done before a resume: steps 3..7 of the epoch.
    assert [s[:3] for s in hook.steps] == [
        (3, 13, True),
        (4, 14, True),
        (5, 15, True),
        (6, 16, True),
        (7, 17, True),
    ]
    assert [s[3] for s in hook.steps] == [4, 8, 12, 16, 20]  # the running sums, per step
    assert [g for g, _ in hook.logs] == [14, 16]
    for _, logged in hook.logs:
        assert set(logged) == {"train_loss", "train_acc", "lr", "images_per_sec", "data_wait_share"}
        assert all(type(v) is float for v in logged.values())
        assert logged["images_per_sec"] > 0 and 0.0 <= logged["data_wait_share"] <= 1.0
    assert metrics["steps"] == 7


def test_a_hook_stops_the_epoch_and_a_disabled_logger_costs_no_read():
    quiet = Recorder(enabled=False)
    stopper = Recorder(stop_at=2)
    metrics = train_one_epoch(
        tiny_state(), batches(5), hooks=[quiet, stopper], epoch=EpochPlan(log_interval=1)
    )
    assert metrics["steps"] == 2 and metrics["train_samples"] == 8
    assert quiet.logs == [] and len(quiet.steps) == 2  # disabled: no logging step calls


def test_a_step_the_grad_scaler_skips_is_not_taken():
    state = tiny_state(torch.amp.GradScaler("cpu", init_scale=2.0**16))
    poisoned = batches(2)
    poisoned[1] = (torch.full_like(poisoned[1][0], float("inf")), poisoned[1][1])
    hook = Recorder()
    train_one_epoch(state, poisoned, hooks=[hook])
    assert [taken for _, _, taken, _ in hook.steps] == [True, False]


# ----------------------------------------------------------------------------- DDP internals


def test_the_installed_torch_has_the_ddp_internals_the_retry_resets(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        check_ddp_internals(ddp)
        ddp.require_forward_param_sync = False
        reset_ddp_after_failed_attempt(ddp)
        assert ddp.require_forward_param_sync and not ddp._has_rebuilt_buckets
        ddp(torch.randn(3, 2)).sum().backward()  # still trains after the reset
    finally:
        dist.destroy_process_group()


def test_missing_ddp_internals_are_named():
    class OldDDP:
        reducer = object()
        _has_rebuilt_buckets = True

    with pytest.raises(RuntimeError, match=r"reducer\._reset_state, ddp\.require_forward_param"):
        check_ddp_internals(OldDDP())
    check_ddp_internals(None)  # a plain model: nothing to check


# ----------------------------------------------------------------------------- the schema


def test_the_checkpoint_holds_exactly_the_schema(trained_run):
    state = load_checkpoint_file(trained_run.best)
    assert state.keys() == CHECKPOINT_SCHEMA.keys()
    assert state["format_version"] == CHECKPOINT_FORMAT
    with pytest.raises(ValueError, match="missing"):
        training_checkpoint(epoch=1)


def test_a_newer_checkpoint_is_one_error_line(trained_run, tmp_path, capsys):
    workdir = trained_run.copy_to(tmp_path)
    latest = workdir / "checkpoints" / "checkpoint_latest.pth"
    state = torch.load(latest, weights_only=True)
    # Not a damaged file: refused, without falling back to the previous checkpoint.
    torch.save(state, workdir / "checkpoints" / "checkpoint_latest.prev.pth")
    torch.save({**state, "format_version": CHECKPOINT_FORMAT + 1}, latest)
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", *trained_run.flags, "--epochs", "3", "--resume", latest],
        capsys,
        cwd=workdir,
    )
    assert f"format version {CHECKPOINT_FORMAT + 1}" in line and "newer" in line


@pytest.mark.slow
def test_a_checkpoint_without_a_version_still_resumes(trained_run, tmp_path):
    """Written before versions existed: the tests' shared runs and users' files."""
    workdir = trained_run.copy_to(tmp_path)
    latest = workdir / "checkpoints" / "checkpoint_latest.pth"
    state = torch.load(latest, weights_only=True)
    del state["format_version"]
    torch.save(state, latest)
    assert run_train([*trained_run.flags, "--epochs", "3", "--resume", latest], cwd=workdir) == 0
    assert load_checkpoint_file(latest)["epoch"] == 3

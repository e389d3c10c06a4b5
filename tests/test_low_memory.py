"""--accum_steps, --low_memory and automatic micro-batch fitting, all on the CPU: out-of-memory
errors are injected (a model that raises torch.OutOfMemoryError) or come from a memory budget.
The CUDA-only paths have their own tests at the end, skipped without a GPU."""

from __future__ import annotations

import datetime
import json
import logging
import os
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import imgtrainer.run.train as train_ddp
from conftest import CPU, FP32, RESNET18, TINY_FLAGS, launch_on_cpu, user_error_line
from imgtrainer.config import parse_config, preset_summary
from imgtrainer.errors import UserError
from imgtrainer.precision import Precision
from imgtrainer.torch_compat import is_out_of_memory, none_if_out_of_memory
from imgtrainer.training.evaluation import EvalSettings, evaluate
from imgtrainer.training.loop import train_one_epoch
from imgtrainer.training.memory import MemoryPlan, enable_memory_savers, halving_sizes
from imgtrainer.training.memory_fit import (
    TrialInputs,
    TrialParts,
    fit_micro_batch,
    largest_fitting,
    measure_micro_batch,
)
from imgtrainer.training.memory_probes import StepCost
from imgtrainer.training.step import RunParts

HUGE = 2**40  # a budget nothing reaches
GIB = 2**30


class OutOfMemoryAt(nn.Module):
    """Wraps a model: its forward raises torch.OutOfMemoryError (what CUDA raises) at the given
    call numbers (counted from 0), or for every micro-batch larger than ``limit`` images."""

    def __init__(self, model: nn.Module, calls: tuple[int, ...] = (), limit: int | None = None):
        super().__init__()
        self.model, self.fail_calls, self.limit, self.calls = model, set(calls), limit, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if call in self.fail_calls or (self.limit is not None and len(x) > self.limit):
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"
            )
        return self.model(x)


def small_model(batch_norm: bool = False) -> nn.Module:
    """A small CNN; without BatchNorm, micro-batching cannot change its gradients."""
    torch.manual_seed(0)
    norm = nn.BatchNorm2d(8) if batch_norm else nn.Identity()
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        norm,
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    # A buffer that is not BatchNorm's: DDP broadcasts buffers, which the two-process test needs.
    model.register_buffer("marker", torch.ones(2))
    return model


def batches(count: int, size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, 12, 12, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(count)
    ]


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(
    model: nn.Module,
    loader,
    plan: MemoryPlan | None,
    optimizer: str = "sgd",
    scaler: torch.amp.GradScaler | None = None,
) -> dict:
    opt = make_optimizer(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)
    state = RunParts(
        model, opt, scheduler, scaler, nn.CrossEntropyLoss(), FP32, plan or MemoryPlan(), CPU
    )
    return train_one_epoch(state, loader)


def max_difference(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_accumulating_4x8_equals_one_step_on_32(optimizer):
    whole, accumulated = small_model(), small_model()
    loader = batches(1, 32)
    ref = train(whole, loader, None, optimizer)
    got = train(accumulated, loader, MemoryPlan(8), optimizer)
    assert max_difference(whole, accumulated) < 1e-5
    assert (got["steps"], got["train_samples"]) == (ref["steps"], ref["train_samples"]) == (1, 32)
    assert got["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-6)
    assert max_difference(small_model(), whole) > 1e-3  # the step did move the weights


def test_grad_scaler_unscales_the_accumulated_gradient_once():
    """The float16 recipe (scale each micro-batch's loss, step and update once) on the CPU,
    where GradScaler also runs: scaling by a power of two is exact in float32."""
    whole, accumulated = small_model(), small_model()
    loader = batches(2, 16)
    train(whole, loader, None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=True)
    train(accumulated, loader, MemoryPlan(4), scaler=scaler)
    assert max_difference(whole, accumulated) < 1e-5
    assert scaler.get_scale() == 2.0**10  # no overflow, no step skipped


def test_evaluation_in_micro_batches_gives_the_same_metrics():
    model = small_model(batch_norm=True)
    loader = batches(2, 10)
    whole = evaluate(model, loader, EvalSettings(CPU, FP32, None, False))
    split = evaluate(model, loader, EvalSettings(CPU, FP32, MemoryPlan(4), False))
    assert split["val_samples"] == whole["val_samples"] == 20
    for key in ("val_loss", "val_acc", "val_top5"):
        assert split[key] == pytest.approx(whole[key], abs=1e-6)


# ----------------------------------------------------------------------------- the preset


def test_low_memory_preset_and_explicit_flags_win(caplog):
    from imgtrainer.precision import choose_precision

    cfg = parse_config(["--low_memory"])
    assert (
        cfg.use_amp,
        cfg.channels_last,
        cfg.grad_checkpointing,
        cfg.auto_micro_batch,
        cfg.num_workers,
        cfg.prefetch_factor,
    ) == (True, True, True, True, None, 1)
    mine = parse_config(
        ["--low_memory", "--no_grad_checkpointing", "--num_workers", "0", "--max_memory_gb", "2"]
    )
    assert (mine.grad_checkpointing, mine.num_workers, mine.use_amp) == (False, 0, True)
    summary = preset_summary(mine, "low_memory")
    assert "use_amp=True" in summary and "your flags kept: grad_checkpointing=False" in summary
    # float16 on CUDA; float32 on the CPU, where bfloat16 autocast is much slower.
    assert choose_precision(cfg, torch.device("cuda")) == Precision(True, torch.float16)
    with caplog.at_level(logging.INFO, logger="imgtrainer"):
        assert choose_precision(cfg, CPU) == FP32
    assert "float32" in caplog.text
    with pytest.raises(UserError, match="--max_memory_gb"):
        parse_config(["--max_memory_gb", "2"])  # a budget without fitting does nothing
    with pytest.raises(UserError, match="--sync_bn cannot be combined"):
        parse_config(["--low_memory", "--sync_bn"])
    assert parse_config(["--low_memory", "--sync_bn", "--no_auto_micro_batch"]).sync_bn


def test_low_memory_checkpoints_the_early_layers_exactly_and_keeps_less():
    """--low_memory's checkpointing (the ResNet stem and first stage) gives the gradients and
    BatchNorm statistics of no checkpointing, bitwise; its forward keeps less than timm's
    checkpointing of every block (which keeps the stem's activations) and the fitting's
    measurement sees it; the EMA's deep copy checkpoints itself."""
    import copy

    from imgtrainer.models import build_model
    from imgtrainer.training.memory import checkpointing_in_use
    from imgtrainer.training.memory_fit import TrialInputs, TrialParts, measure_micro_batch

    torch.manual_seed(0)
    plain = build_model("test_resnet", 3)  # timm's small ResNet: the same stem and stages
    early, every = copy.deepcopy(plain), copy.deepcopy(plain)
    enable_memory_savers(early, grad_checkpointing=True, channels_last=False, early_only=True)
    enable_memory_savers(every, grad_checkpointing=True, channels_last=False)
    enable_memory_savers(
        small_model(), grad_checkpointing=False, channels_last=False, early_only=True
    )
    assert [checkpointing_in_use(m) for m in (plain, early, every)] == [
        "off",
        "early layers",
        "every block",
    ]
    images, targets = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    for model in (plain, early):
        nn.functional.cross_entropy(model(images), targets).backward()
    for (name, a), b in zip(plain.named_parameters(), early.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(plain.named_buffers(), early.buffers(), strict=True):
        assert torch.equal(a, b), name  # the recomputation is not counted again

    def saved_bytes(model: nn.Module) -> int:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        parts = TrialParts(model, optimizer, nn.CrossEntropyLoss(), FP32, CPU)
        return measure_micro_batch(parts, TrialInputs((3, 32, 32), 3), 2).batch_bytes

    kept = {
        name: saved_bytes(m) for name, m in (("off", plain), ("early", early), ("every", every))
    }
    assert kept["early"] < 0.5 * kept["off"] and kept["early"] < kept["every"] < kept["off"]

    ema = copy.deepcopy(early)
    assert ema.forward_features.args[0] is ema and checkpointing_in_use(ema) == "early layers"
    with torch.no_grad():
        assert torch.equal(ema.eval()(images), early.eval()(images))


def test_memory_savers_on_a_timm_model_and_a_plain_one(caplog):
    from imgtrainer.models import build_model

    timm_model = build_model("resnet18", 3)
    enable_memory_savers(timm_model, grad_checkpointing=True, channels_last=True)
    assert timm_model.grad_checkpointing
    assert timm_model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        enable_memory_savers(small_model(), grad_checkpointing=True, channels_last=False)
    assert "no activation checkpointing" in caplog.text


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
        )
    )
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_an_attempt_out_of_memory_is_none_only_where_it_can_be_retried(caplog):
    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")

    def broken():
        raise RuntimeError("shape mismatch")

    assert none_if_out_of_memory(lambda: 3) == 3
    assert none_if_out_of_memory(out_of_memory, release=torch.device("cpu")) is None
    for attempt, retry in ((out_of_memory, False), (broken, True)):
        with pytest.raises(RuntimeError):
            none_if_out_of_memory(attempt, retry)
    with caplog.at_level(logging.ERROR, logger="imgtrainer"):
        with pytest.raises(torch.OutOfMemoryError):
            none_if_out_of_memory(out_of_memory, cannot_redo="cannot be redone here")
    assert [r.getMessage() for r in caplog.records] == ["cannot be redone here"]


# ----------------------------------------------------------------------------- fitting


def test_halving_keeps_every_micro_batch_a_divisor():
    assert halving_sizes(64, 64) == [64, 32, 16, 8, 4, 2, 1]
    assert halving_sizes(48, 48) == [48, 24, 12, 6, 3, 1]
    assert halving_sizes(30, 30) == [30, 15, 6, 3, 1]
    assert halving_sizes(12, 36) == [12, 6, 3, 1]  # from --batch_size 12 --accum_steps 3


def fit_with(model: nn.Module, start: int, batch_size: int, budget: int = HUGE) -> int:
    measure = partial(
        measure_micro_batch,
        TrialParts(model, make_optimizer(model, "adamw"), nn.CrossEntropyLoss(), FP32, CPU),
        TrialInputs((3, 12, 12), num_classes=3),
    )
    return fit_micro_batch(measure, start, batch_size, budget, CPU)


def test_fitting_halves_until_the_injected_limit():
    assert fit_with(OutOfMemoryAt(small_model(), limit=7), start=48, batch_size=48) == 6
    assert fit_with(OutOfMemoryAt(small_model(), limit=64), start=16, batch_size=64) == 16


def test_fitting_under_a_budget_uses_the_measured_cost_and_leaves_the_model_as_it_was():
    model = small_model(batch_norm=True)
    measure = partial(
        measure_micro_batch,
        TrialParts(model, make_optimizer(model, "adamw"), nn.CrossEntropyLoss(), FP32, CPU),
        TrialInputs((3, 12, 12), num_classes=3),
    )
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    costs = {m: measure(m) for m in (2, 8, 16)}
    # What the forward keeps for backward grows with the micro-batch; the state does not.
    assert costs[16].batch_bytes == pytest.approx(2 * costs[8].batch_bytes, rel=0.05)
    assert costs[2].state_bytes == costs[16].state_bytes
    params = sum(p.numel() * 4 for p in model.parameters())
    assert costs[2].state_bytes >= 4 * params  # weights, gradients, two AdamW moments
    # BatchNorm's statistics untouched:
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())

    budget = (costs[8].total + costs[16].total) // 2
    tried = []

    def counting(m: int) -> StepCost:
        tried.append(m)
        return measure(m)

    assert largest_fitting(counting, 32, 32, budget) == (8, "")
    # The 2-image probe's estimate ruled out 32 and 16 without running them.
    assert tried == [2, 8]


def test_nothing_fits_is_one_clear_error(tiny_dataset, tmp_path: Path, capsys):
    with pytest.raises(UserError, match="even with a micro-batch of 1 .*--image_size"):
        fit_with(OutOfMemoryAt(small_model(), limit=0), start=8, batch_size=8)
    train_dir, val_dir = tiny_dataset
    line = user_error_line(
        train_ddp.main,
        [
            "--device",
            "cpu",
            "--train_dir",
            train_dir,
            "--val_dir",
            val_dir,
            "--low_memory",
            "--max_memory_gb",
            "0.01",
            *TINY_FLAGS,
            *RESNET18,  # the product's model does not fit 0.01 GiB
        ],
        capsys,
        cwd=tmp_path,
    )
    assert all(
        phrase in line for phrase in ("micro-batch of 1", "budget 0.01 GiB", "--image_size")
    ), line
    assert not (tmp_path / "checkpoints" / "checkpoint_latest.pth").exists()


# ----------------------------------------------------------------------------- OOM in training


def test_out_of_memory_mid_training_halves_and_redoes_the_step():
    loader = batches(4, 16)
    reference = small_model()
    train(reference, loader, MemoryPlan(8, retry_on_oom=True))
    # Forward calls 0-3 are steps 1-2 (2 micro-batches of 8 each); call 5 is the second
    # micro-batch of step 3, after the first one's gradient was already accumulated.
    hit = OutOfMemoryAt(small_model(), calls=(5,))
    plan = MemoryPlan(8, retry_on_oom=True)
    metrics = train(hit, loader, plan)
    assert plan.micro_batch == metrics["micro_batch"] == 4
    assert (metrics["steps"], metrics["train_samples"]) == (4, 64)
    assert hit.calls == 4 + 2 + 4 + 4  # steps 1-2, the failed attempt, steps 3-4 by 4
    assert max_difference(reference, hit.model) < 1e-5  # nothing skipped, nothing twice


def test_a_redone_step_leaves_batchnorm_statistics_counted_once():
    hit = OutOfMemoryAt(small_model(batch_norm=True), calls=(3,))
    train(hit, batches(2, 16), MemoryPlan(8, retry_on_oom=True))
    # Step 1: 2 forwards of 8. Step 2: one forward of 8, then the failure; redone as 4 of 4.
    assert hit.model[1].num_batches_tracked.item() == 2 + 4


def test_out_of_memory_with_a_micro_batch_of_1_is_one_clear_error():
    with pytest.raises(UserError, match="even with a micro-batch of 1 during training"):
        train(OutOfMemoryAt(small_model(), limit=0), batches(1, 4), MemoryPlan(4, True))
    with pytest.raises(torch.OutOfMemoryError):  # no retry asked for: the error goes through
        train(OutOfMemoryAt(small_model(), calls=(0,)), batches(1, 4), MemoryPlan(4))


# ----------------------------------------------------------------------------- two processes


def _agreement_worker(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        result = {}
        # Fitting: rank 0 fits 16 images, rank 1 only 4; both must use 4.
        result["fitted"] = fit_with(OutOfMemoryAt(small_model(), limit=(16, 4)[rank]), 16, 16)
        # Nothing fits on rank 1: both ranks stop with the error, neither hangs.
        try:
            fit_with(OutOfMemoryAt(small_model(), limit=(16, 0)[rank]), 16, 16)
        except UserError as err:
            result["error"] = str(err)
        # Training under DDP: rank 1 alone runs out of memory in the last (synchronised)
        # micro-batch of step 1: both ranks redo it with micro-batches of 4.
        hit = OutOfMemoryAt(small_model(), calls=(1,) if rank == 1 else ())
        plan = MemoryPlan(8, retry_on_oom=True)
        metrics = train(DDP(hit), batches(2, 16, seed=rank), plan)
        result.update(
            micro_batch=plan.micro_batch,
            steps=metrics["steps"],
            samples=metrics["train_samples"],
            params=[p.detach().flatten().tolist() for p in hit.model.parameters()],
        )
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_agree_on_the_micro_batch_and_redo_steps_together(tmp_path: Path):
    from imgtrainer.run.launcher import free_port

    mp.spawn(_agreement_worker, args=(free_port(), tmp_path), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["fitted"] for r in results] == [4, 4]
    assert "micro-batch of 1 (on another process" in results[0]["error"]
    assert "micro-batch of 1 (out of memory" in results[1]["error"]
    assert [(r["micro_batch"], r["steps"], r["samples"]) for r in results] == [(4, 2, 64)] * 2

    # The same two steps in one process, on both ranks' batches at once.
    reference = small_model()
    global_batches = [
        (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
        for a, b in zip(batches(2, 16, seed=0), batches(2, 16, seed=1), strict=True)
    ]
    train(reference, global_batches, None)
    expected = [p.detach().flatten() for p in reference.parameters()]
    for r in results:
        got = [torch.tensor(p) for p in r["params"]]
        assert max((g - e).abs().max().item() for g, e in zip(got, expected, strict=True)) < 1e-5


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_low_memory_end_to_end_through_the_launcher(tiny_dataset, tmp_path: Path):
    train_dir, val_dir = tiny_dataset
    result = launch_on_cpu(
        train_dir,
        val_dir,
        *("--epochs", "1", "--low_memory", "--accum_steps", "2", "--max_memory_gb", "4"),
        # 2 batches of 4 per step: 8 images, as --batch_size 8 in TINY_FLAGS
        *("--batch_size", "4"),
        # timm's small ResNet: the same stem and stages as resnet18 (what --low_memory
        # checkpoints), at a fraction of its compute.
        *("--model", "test_resnet"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "--low_memory chose: use_amp=True, channels_last=True, grad_checkpointing=True" in out
    assert "training in float32" in out
    assert "Memory: micro-batch 4 (2 forward/backward pass(es) per optimizer step of 8" in out
    assert (
        "Effective batch: --batch_size 4 x --accum_steps 2 x 2 process(es) = 16 images per "
        "optimizer step"
    ) in out
    assert "activation checkpointing early layers" in out

    history = json.loads((tmp_path / "logs" / "training_history.json").read_text())
    assert history["config"]["low_memory"] and history["config"]["accum_steps"] == 2
    assert [r["micro_batch"] for r in history["epochs"]] == [4]
    latest = torch.load(tmp_path / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    assert latest["micro_batch"] == 4 and latest["epoch"] == 1
    assert latest["effective_batch_size"] == 16


# ----------------------------------------------------------------------------- CUDA only


def cuda(test):
    """Selected by ``pytest -m cuda``; skipped without a GPU."""
    return pytest.mark.cuda(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test)
    )


@cuda
def test_cuda_float16_channels_last_accumulation():
    from imgtrainer.models import build_model

    device = torch.device("cuda")
    model = build_model("resnet18", 3)
    enable_memory_savers(model, grad_checkpointing=True, channels_last=True)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cuda")
    plan = MemoryPlan(4, retry_on_oom=True, channels_last=True)
    state = RunParts(
        model,
        opt,
        scheduler,
        scaler,
        nn.CrossEntropyLoss(),
        Precision(True, torch.float16),
        plan,
        device,
    )
    metrics = train_one_epoch(state, batches(2, 16))
    assert (metrics["steps"], metrics["train_samples"]) == (2, 32)
    assert torch.isfinite(torch.tensor(metrics["train_loss"]))
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)


@cuda
def test_cuda_fitting_meets_a_real_out_of_memory_error():
    """A memory fraction makes large trials raise torch.cuda.OutOfMemoryError for real."""
    from imgtrainer.models import build_model
    from imgtrainer.training.memory_probes import optimizer_state_bytes

    # With an index: torch.cuda.set_per_process_memory_fraction refuses a bare "cuda".
    device = torch.device("cuda", torch.cuda.current_device())
    model = build_model("resnet18", 3).to(device)
    optimizer = make_optimizer(model, "adamw")
    trial = partial(
        measure_micro_batch,
        TrialParts(model, optimizer, nn.CrossEntropyLoss(), FP32, device),
        TrialInputs((3, 224, 224), num_classes=3),
    )
    costs = {}  # the trials that ran, by size (a second trial at the cap's edge may not fit)

    def measure(size: int):
        costs[size] = trial(size)
        return costs[size]

    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.5 * GIB / total, device)
    try:
        size = fit_micro_batch(measure, 512, 512, HUGE, device)
        cost = costs[size]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    assert 1 <= size < 512 and 512 % size == 0
    # The real peak of the trial that fitted, without the optimizer state it will add later.
    assert cost.peak_bytes - optimizer_state_bytes(optimizer) <= 1.5 * GIB


def test_ddp_is_found_inside_a_compiled_model(tmp_path):
    """--compile wraps DDP in torch.compile: no_sync and the OOM reset must still reach DDP."""
    from imgtrainer.training.step import _no_sync, ddp_of

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        compiled = torch.compile(ddp)
        assert ddp_of(compiled) is ddp and ddp_of(ddp) is ddp
        assert ddp_of(torch.nn.Linear(2, 2)) is None
        with _no_sync(compiled):
            assert not ddp.require_backward_grad_sync
        assert ddp.require_backward_grad_sync
    finally:
        dist.destroy_process_group()

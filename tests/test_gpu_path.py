"""The CUDA paths: their logic on the CPU, and `cuda`-marked tests that run the CUDA side for
real (skipped without a GPU; `python -m pytest -m cuda tests/` runs them with tests/gpu/'s runs
through the launcher)."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import imgtrainer.distributed.collectives as distributed
import imgtrainer.distributed.setup as dist_setup
import imgtrainer.training.step as training_step
from conftest import CPU, FP32, ROOT, cpu_run_parts
from imgtrainer.models import strip_wrapper_prefixes
from imgtrainer.precision import configure_backends
from imgtrainer.torch_compat import is_out_of_memory
from imgtrainer.training.loop import train_one_epoch
from imgtrainer.training.memory import MemoryPlan
from imgtrainer.training.memory_fit import (
    TrialInputs,
    TrialParts,
    largest_fitting,
    measure_micro_batch,
)
from imgtrainer.training.memory_probes import ResidentMemory, batch_input_bytes, cpu_baseline
from imgtrainer.training.optim import restore_optimizer_state

HAS_CUDA = torch.cuda.is_available()


def cuda_test(fn):
    """Selected by ``pytest -m cuda``; skipped without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(fn))


class GlobalMean(nn.Module):
    """Global average pooling whose backward is deterministic on CUDA too (an expand)."""

    def forward(self, x):
        return x.mean((2, 3))


def conv_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), GlobalMean(), nn.Linear(8, 3)
    )


def batches(count: int, size: int, seed: int = 0, side: int = 12):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, side, side, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(count)
    ]


def make_optimizer(model: nn.Module, name: str, fused: bool | None = None):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01, fused=fused)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)


def sgd_steps(model: nn.Module, optimizer, loader, device=CPU, scaler=None) -> None:
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# ----------------------------------------------------------------------------- 1: resume


def as_written_elsewhere(state: dict) -> dict:
    """The same optimizer state as a fused, channels_last run would have written it."""
    other = copy.deepcopy(state)
    for group in other["param_groups"]:
        group["fused"] = True
    for slots in other["state"].values():
        for key, value in slots.items():
            if torch.is_tensor(value) and value.dim() == 4:
                slots[key] = value.contiguous(memory_format=torch.channels_last)
    return other


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_resume_runs_with_this_runs_flags_and_parameter_layout(name, tmp_path):
    model = conv_model()
    optimizer = make_optimizer(model, name)
    sgd_steps(model, optimizer, batches(2, 8))
    clean = optimizer.state_dict()
    torch.save(
        {"clean": clean, "other": as_written_elsewhere(clean), "weights": model.state_dict()},
        tmp_path / "ckpt.pth",
    )
    ckpt = torch.load(tmp_path / "ckpt.pth", weights_only=True)
    assert ckpt["other"]["param_groups"][0]["fused"] is True

    resumed = {}
    for which in ("clean", "other"):
        model = conv_model(seed=1)
        model.load_state_dict(ckpt["weights"])
        optimizer = make_optimizer(model, name)  # this run: fused=None (foreach kernels)
        restore_optimizer_state(optimizer, ckpt[which])
        assert all(group["fused"] is None for group in optimizer.param_groups)
        for param in model.parameters():
            for value in optimizer.state[param].values():
                if torch.is_tensor(value) and value.shape == param.shape:
                    assert value.stride() == param.stride() and value.device == param.device
        if name == "adamw":
            step = optimizer.state[model[0].weight]["step"]
            assert step.device == CPU and step.dtype == torch.float32 and step.item() == 2
        sgd_steps(model, optimizer, batches(3, 8, seed=5))
        resumed[which] = model.state_dict()
    for key, value in resumed["clean"].items():
        assert torch.equal(value, resumed["other"][key]), key


# ----------------------------------------------------------------------------- 2, 6: host group


def test_host_group_is_made_once_with_the_timeout_and_any_rank_agrees_on_the_host(
    tmp_path, monkeypatch
):
    """Under NCCL (the backend faked: the default group here is gloo), the host group is a gloo
    group made once, with the timeout given, and any_rank all-reduces a CPU tensor through it."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        made, reduced = [], []
        real_new_group, real_all_reduce = dist.new_group, dist.all_reduce
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or real_new_group(**kw))
        monkeypatch.setattr(
            dist,
            "all_reduce",
            lambda t, op=None, group=None: (
                reduced.append((t.device, group)),
                real_all_reduce(t, op=op, group=group),
            )[1],
        )
        timeout = datetime.timedelta(minutes=7)
        group = distributed.host_group(timeout)
        assert distributed.any_rank(True) is True
        assert distributed.any_rank(False) is False
        assert distributed.host_group() is group
        assert made == [{"backend": "gloo", "timeout": timeout}]
        assert reduced == [(CPU, group), (CPU, group)]
    finally:
        dist.destroy_process_group()


def test_setup_makes_the_host_group_with_the_dist_timeout(monkeypatch):
    """setup_distributed as rank 0 of 2 under NCCL, faked: one gloo process and a local store."""
    made = []
    real_init, real_new_group = dist.init_process_group, dist.new_group
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist_setup, "_rendezvous_store", lambda world_size: dist.HashStore())
    monkeypatch.setattr(
        dist,
        "init_process_group",
        lambda backend, **kw: real_init(
            "gloo", store=kw["store"], rank=0, world_size=1, timeout=kw["timeout"]
        ),
    )
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or real_new_group(**kw))
    threads = torch.get_num_threads()
    try:
        dist_setup.setup_distributed("cpu", timeout_minutes=7)
        assert made == [{"backend": "gloo", "timeout": datetime.timedelta(minutes=7)}]
        distributed.any_rank(False)
        assert len(made) == 1  # reused, not made again
    finally:
        dist_setup.cleanup_distributed()
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- 3: OOM agreement


class Recorder(nn.Module):
    """Logs each forward in ``events``; any_rank calls are logged there too."""

    def __init__(self, model: nn.Module, events: list):
        super().__init__()
        self.model, self.events = model, events

    def forward(self, x):
        self.events.append("forward")
        return self.model(x)


def test_ranks_agree_on_the_input_copy_before_the_first_forward(monkeypatch):
    events: list = []
    real_to_device = training_step.to_device
    copies = {"count": 0}

    def to_device(*args, **kwargs):
        copies["count"] += 1
        if copies["count"] == 3:  # step 2's first micro-batch: this rank cannot copy it
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the copy)")
        return real_to_device(*args, **kwargs)

    monkeypatch.setattr(training_step, "to_device", to_device)
    monkeypatch.setattr(
        training_step, "any_rank", lambda flag: events.append(("agree", flag)) or flag
    )
    model = Recorder(conv_model(), events)
    plan = MemoryPlan(4, retry_on_oom=True)
    loader = batches(2, 8)
    opt = make_optimizer(model, "sgd")
    metrics = train_one_epoch(cpu_run_parts(model, opt, plan), loader)
    # Step 1: agree (copy ok), 2 forwards, agree. Step 2: the copy fails: agreed on before any
    # forward; redone with micro-batch 2: agree, 4 forwards, agree.
    assert events == (
        [("agree", False), "forward", "forward", ("agree", False)]
        + [("agree", True)]
        + [("agree", False)]
        + ["forward"] * 4
        + [("agree", False)]
    )
    assert (metrics["steps"], metrics["train_samples"], plan.micro_batch) == (2, 16, 2)

    reference = conv_model()
    ref_opt = make_optimizer(reference, "sgd")
    sgd_steps(reference, ref_opt, loader)
    for p, q in zip(reference.parameters(), model.model.parameters(), strict=True):
        assert (p - q).abs().max().item() < 1e-5


class FailingForward(nn.Module):
    def __init__(self, model: nn.Module, calls: set[int]):
        super().__init__()
        self.model, self.fail, self.calls = model, calls, 0

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        if call in self.fail:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the forward)")
        return self.model(x)


def _copy_failure_worker(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        copies = {"count": 0}
        real_to_device = training_step.to_device

        def to_device(*args, **kwargs):
            copies["count"] += 1
            # Rank 1: its last forward of step 1 fails (a redo: DDP rebuilds its buckets in
            # the next forward), then the first copy of the redo fails too.
            if rank == 1 and copies["count"] == 3:
                raise torch.OutOfMemoryError("CUDA out of memory (injected in the copy)")
            return real_to_device(*args, **kwargs)

        training_step.to_device = to_device
        hit = FailingForward(conv_model(), {1} if rank == 1 else set())
        plan = MemoryPlan(4, retry_on_oom=True)
        model = DDP(hit)
        opt = make_optimizer(model, "sgd")
        metrics = train_one_epoch(cpu_run_parts(model, opt, plan), batches(2, 8, seed=rank))
        (out / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "micro_batch": plan.micro_batch,
                    "steps": metrics["steps"],
                    "params": [p.detach().flatten().tolist() for p in hit.model.parameters()],
                }
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_redo_a_step_whose_copy_failed_on_one_rank(tmp_path):
    from imgtrainer.run.launcher import free_port

    mp.spawn(_copy_failure_worker, args=(free_port(), tmp_path), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["micro_batch"], r["steps"]) for r in results] == [(1, 2)] * 2
    reference = conv_model()
    both = [
        (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
        for a, b in zip(batches(2, 8, seed=0), batches(2, 8, seed=1), strict=True)
    ]
    sgd_steps(reference, make_optimizer(reference, "sgd"), both)
    for r in results:
        for got, want in zip(r["params"], reference.parameters(), strict=True):
            assert (torch.tensor(got) - want.detach().flatten()).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------- 4: batch inputs


def test_the_loaded_batch_inputs_count_in_the_fitting():
    # On CUDA the batch is augmented on the device straight into the model's layout: the
    # step's move to that layout copies nothing, with channels_last or without.
    assert batch_input_bytes(64, 224) == 64 * 3 * 224**2 * 4
    model = conv_model()
    parts = TrialParts(model, make_optimizer(model, "adamw"), nn.CrossEntropyLoss(), FP32, CPU)
    inputs = TrialInputs((3, 12, 12), num_classes=3)
    measure = partial(measure_micro_batch, parts, inputs)
    with_loaded = partial(
        measure_micro_batch, parts, dataclasses.replace(inputs, loaded_input_bytes=50 * 2**20)
    )
    alone, loaded = measure(4), with_loaded(4)
    assert alone.input_bytes == 4 * 3 * 12 * 12 * 4
    assert (
        loaded.input_bytes == 50 * 2**20
        and loaded.total - alone.total == 50 * 2**20 - alone.input_bytes
    )
    # The inputs of the loaded batch do not shrink with the micro-batch.
    assert loaded.estimate(2) - alone.estimate(2) == loaded.total - alone.total
    budget = alone.total + 2**20
    assert largest_fitting(measure, 4, 4, budget)[0] == 4
    assert largest_fitting(with_loaded, 4, 4, budget)[0] == 0


# ----------------------------------------------------------------------------- 5: OOM messages


@pytest.mark.parametrize(
    "message",
    [
        "Unable to find a valid cuDNN algorithm to run convolution",
        "GET was unable to find an engine to execute this computation",
        "FIND was unable to find an engine to execute this computation",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory",
    ],
)
def test_cudnn_and_cublas_exhaustion_counts_as_out_of_memory(message):
    assert is_out_of_memory(RuntimeError(message))


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: CUBLAS_STATUS_INVALID_VALUE"),
        RuntimeError("cuDNN error: CUDNN_STATUS_BAD_PARAM"),
        RuntimeError(
            "Given groups=1, weight of size [8, 3, 3, 3], expected input to have 3 channels"
        ),
        ValueError("Unable to find a valid cuDNN algorithm"),  # not a RuntimeError: not ours
    ],
)
def test_other_errors_are_not_out_of_memory(error):
    assert not is_out_of_memory(error)


# ----------------------------------------------------------------------------- 7: set-up


def test_trainer_and_benchmarks_share_the_kernel_set_up(monkeypatch):
    saved = (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        configure_backends(torch.device("cuda"), deterministic=False)
        assert torch.backends.cudnn.benchmark and not torch.are_deterministic_algorithms_enabled()
        configure_backends(torch.device("cuda"), deterministic=True)
        assert not torch.backends.cudnn.benchmark and torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.backends.cudnn.benchmark = saved[0]
        torch.use_deterministic_algorithms(saved[1])
    for script in ("bench/throughput.py", "bench/memory.py", "src/imgtrainer/run/train.py"):
        assert "configure_backends(" in (ROOT / script).read_text(), script


# ----------------------------------------------------------------------------- 8: evaluate


class FixedLogits(nn.Module):
    """Returns the logits stored for each image, found by its first pixel (its index)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("table", logits)

    def forward(self, x):
        return self.table[x[:, 0, 0, 0].long()]


def _indexed_loader(targets: torch.Tensor, batch_size: int):
    from torch.utils.data import DataLoader, TensorDataset

    from imgtrainer.data.host.samplers import ShardSampler

    images = torch.arange(len(targets), dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 2, 2)
    dataset = TensorDataset(images.contiguous(), targets)
    return DataLoader(dataset, batch_size=batch_size, sampler=ShardSampler(len(targets), 0, 1))


def _evaluate(device: torch.device, count: int = 40, classes: int = 7):
    from imgtrainer.tools.inference import Classifier
    from imgtrainer.tools.scoring import count_predictions

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(count, classes, generator=g)
    targets = torch.randint(0, classes, (count,), generator=g)
    model = FixedLogits(logits).to(device)
    classifier = Classifier(
        model, [f"c{k}" for k in range(classes)], 2, None, (0.0,) * 3, (1.0,) * 3
    )
    counts = count_predictions(
        classifier, _indexed_loader(targets, 16), device, show_progress=False
    )
    return logits, targets, counts


def test_evaluation_counts_each_image_once_with_its_prediction():
    logits, targets, counts = _evaluate(CPU)
    predicted = logits.argmax(1)
    confidence = logits.softmax(1).max(1).values
    want = torch.zeros(7, 7, dtype=torch.int64)
    for t, p in zip(targets, predicted, strict=True):
        want[t, p] += 1
    assert counts.confusion.tolist() == want.tolist()
    wrong = [i for i in range(len(targets)) if predicted[i] != targets[i]]
    assert [row[0] for row in counts.misclassified] == wrong and len(wrong) > 10
    for index, pred, conf in counts.misclassified:
        assert pred == predicted[index].item() and conf == pytest.approx(confidence[index].item())


@cuda_test
def test_cuda_evaluation_synchronises_once_per_batch():
    torch.cuda.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _, _, counts = _evaluate(torch.device("cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert counts.images == 40 and len(counts.misclassified) > 10
    # 3 batches: at most one copy each, plus the final sums and confusion matrix.
    assert len(syncs) <= 3 + 4, [str(w.message) for w in syncs]


# ----------------------------------------------------------------------------- 9: prefixes


def test_wrapper_prefixes_are_stripped_from_the_start_only():
    state = {
        "module._orig_mod.layer.submodule.weight": 1,
        "_orig_mod.module.fc.bias": 2,
        "module.module.head.module.x": 3,
        "conv.weight": 4,
        "submodule.weight": 5,
    }
    assert strip_wrapper_prefixes(state) == {
        "layer.submodule.weight": 1,
        "fc.bias": 2,
        "head.module.x": 3,
        "conv.weight": 4,
        "submodule.weight": 5,
    }


# ----------------------------------------------------------------------------- 10: CPU peak


class TemporaryHog(nn.Module):
    """Holds ``per_image`` bytes per image during its forward that it does not keep for backward:
    what a kernel's workspace looks like to a count of saved tensors."""

    def __init__(self, per_image: int):
        super().__init__()
        self.per_image = per_image
        self.linear = nn.Linear(3 * 12 * 12, 3)

    def forward(self, x):
        workspace = torch.ones(len(x), self.per_image // 4)  # written: resident
        return self.linear(x.flatten(1)) + workspace.sum() * 0


@pytest.mark.skipif(not ResidentMemory().available, reason="needs /proc/self/clear_refs (Linux)")
def test_cpu_fitting_measures_the_real_resident_peak():
    per_image = 8 * 2**20
    model = TemporaryHog(per_image)
    optimizer = make_optimizer(model, "adamw")
    resident = ResidentMemory()
    base = partial(
        measure_micro_batch,
        TrialParts(model, optimizer, nn.CrossEntropyLoss(), FP32, CPU),
        TrialInputs((3, 12, 12), num_classes=3),
    )
    measured = partial(
        base, cpu_baseline_bytes=cpu_baseline(model, optimizer, resident), resident=resident
    )
    estimated, real = base(16), measured(16)
    assert estimated.total < 16 * per_image / 4  # the saved tensors miss it
    # The resident peak sees it (to within what other pages of the process came and went).
    assert real.total >= 0.95 * 16 * per_image
    # Largest first, as the fitting runs them: the smaller trial is not hidden in memory the
    # larger one freed.
    small = measured(4)
    assert 0.95 * 4 * per_image <= small.total < 8 * per_image
    budget = 10 * per_image
    assert largest_fitting(base, 16, 16, budget)[0] == 16  # what the estimate let through
    assert largest_fitting(measured, 16, 16, budget)[0] == 8


# ----------------------------------------------------------------------------- CUDA only


@cuda_test
def test_cuda_resume_of_cpu_and_other_layout_checkpoints_with_fused_kernels():
    """A CPU checkpoint (fused off) resumed on CUDA with the float16 GradScaler, and a contiguous
    one resumed into a channels_last model: both step, and equal the layout-matched resume."""
    device = torch.device("cuda")
    model = conv_model()
    optimizer = make_optimizer(model, "adamw")
    sgd_steps(model, optimizer, batches(2, 8))
    cpu_state, weights = optimizer.state_dict(), model.state_dict()

    results = []
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # the two resumes must compute the same
    for transform in (lambda s: s, as_written_elsewhere):
        model = conv_model(seed=1)
        model.load_state_dict(weights)
        model = model.to(device, memory_format=torch.channels_last)
        optimizer = make_optimizer(model, "adamw", fused=True)
        restore_optimizer_state(optimizer, transform(cpu_state))
        assert all(group["fused"] for group in optimizer.param_groups)
        step = optimizer.state[model[0].weight]["step"]
        assert step.device.type == "cuda" and step.item() == 2
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            sgd_steps(model, optimizer, batches(3, 8, seed=5), device, scaler)
        results.append({k: v.float().cpu() for k, v in model.state_dict().items()})
    torch.backends.cudnn.deterministic = deterministic
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key

    # And back: the CUDA (fused) checkpoint resumed on the CPU, without fused.
    model = conv_model(seed=1)
    cpu_optimizer = make_optimizer(model, "adamw")
    restore_optimizer_state(cpu_optimizer, optimizer.state_dict())
    assert all(group["fused"] is None for group in cpu_optimizer.param_groups)
    state = cpu_optimizer.state[model[0].weight]
    assert state["step"].device == CPU and state["exp_avg"].device == CPU
    assert state["exp_avg"].stride() == model[0].weight.stride()


@cuda_test
def test_cuda_any_rank_does_not_synchronise_the_device(tmp_path):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=device
    )
    try:
        distributed.host_group(datetime.timedelta(minutes=1))
        busy = torch.randn(4096, 4096, device=device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                busy = busy @ busy / 4096  # GPU work queued: a sync would wait for it
            assert distributed.any_rank(True) and not distributed.any_rank(False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        dist.destroy_process_group()

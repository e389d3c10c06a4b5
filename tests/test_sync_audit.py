"""No host-device synchronisation between logging steps, and a launch budget per batch that does
not grow with the batch (issue 28): the real loop, step and hooks (EMA, stop agreement, lagged
log) over the real loader of each source, under ``support/sync_audit.py``'s ``SyncAudit``. There
is no GPU here: an op counts when it would make the host wait for a CUDA device (scalar reads,
data-dependent shapes, boolean-mask indexing, blocking device-to-host copies, ``tolist``);
the GPU cache's logic runs on CPU tensors."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import imgtrainer.data.image_plan as image_plan
import imgtrainer.data.loaders as loaders
from conftest import CPU
from imgtrainer.data.host.samples import Source
from imgtrainer.distributed.setup import DistInfo
from imgtrainer.training.memory import BufferSnapshot
from imgtrainer.training.stopping import AGREE_EVERY, StopRequest
from support.harness import write_image_folder
from support.sync_audit import AuditResult, SyncAudit, audit_run

ONE_PROCESS = DistInfo(0, 0, 1, 1, CPU)
CLASSES = ["cat", "dog", "fox"]
LOG_INTERVAL = 4

# Ops dispatched (aten, main thread) per batch by the device half of the data path, the step and
# its hooks (test_resnet, fused SGD, EMA, no augmentation policy, float32): measured 526 (RAM,
# files) and 478 (GPU cache) at batch 8 and at batch 24 alike (torch 2.14.1). The limit leaves
# room for small changes, not for per-sample work (4 ops per sample at batch 24 would add 96).
OPS_PER_BATCH_LIMIT = 760


def image_folders(root: Path, per_class: int) -> tuple[Path, Path]:
    train = write_image_folder(root / "train", CLASSES, per_class, size=20, seed=1)
    return train, write_image_folder(root / "val", CLASSES, 2, size=20, seed=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """42 images: 10 steps of 4 (a partial last batch is dropped)."""
    return image_folders(tmp_path_factory.mktemp("sync"), 14)


@pytest.fixture(scope="module")
def more_data(tmp_path_factory) -> tuple[Path, Path]:
    """72 images: 3 steps of 24 (two of them plain: neither the first nor a logging step), 9 of
    8 (4 plain ones that the data audit skips)."""
    return image_folders(tmp_path_factory.mktemp("budget"), 24)


def gpu_cache_on_the_cpu(monkeypatch) -> None:
    """--cache_images gpu with its canvas on the CPU: the same indices, gathers and
    augmentation as on CUDA."""
    monkeypatch.setattr(loaders, "check_device_options", lambda cfg, device_type: None)
    monkeypatch.setattr(
        image_plan, "choose_source", lambda cache, device: Source.GPU if cache == "gpu" else (
            Source.RAM if cache == "ram" else Source.FILES)
    )  # fmt: skip
    # The canvas fits: the plan packs it on the (CPU) device, as on CUDA.
    monkeypatch.setattr(
        image_plan, "settle_device_cache", lambda cfg, cached, budget, why: ("gpu", why)
    )


def audit(data, monkeypatch, source: str, batch: int, precision: str = "fp32"):
    if source == "gpu":
        gpu_cache_on_the_cpu(monkeypatch)
    return audit_run(*data, source, batch, precision, log_interval=LOG_INTERVAL)


@pytest.mark.parametrize(
    ("source", "precision"),
    [("gpu", "fp32"), ("gpu", "fp16"), ("ram", "fp16"), ("none", "fp32"), ("ram", "bf16")],
)
def test_no_sync_between_logging_steps(data, monkeypatch, source, precision):
    result = audit(data, monkeypatch, source, batch=4, precision=precision)
    assert result.steps == 10
    assert result.unexpected_syncs() == []
    # The logging steps read what the previous one copied: the first has nothing to read.
    log_windows = {w for w, _, _ in result.audit.syncs if result.is_log_step(w)}
    assert "step 4" not in log_windows
    # Each logging step is reported, one late, with its own step; the epoch's end flushes.
    assert [step for step, _ in result.logged] == [4, 8]
    assert precision == "fp16" or result.logged[0][1]["train_loss"] > 0


@pytest.mark.parametrize("source", ["ram", "gpu", "none"])
def test_the_launches_per_batch_do_not_grow_with_the_batch(more_data, monkeypatch, source):
    small = audit(more_data, monkeypatch, source, batch=8)
    large = audit(more_data, monkeypatch, source, batch=24)
    plain, audited = small.ops_per_plain_step(), small.ops_per_plain_step(audited=True)
    large_audited = large.ops_per_plain_step(audited=True)
    assert len(plain) >= 2 and len(audited) >= 2 and len(large_audited) >= 2
    # the same count at every step and at both batch sizes (the large run's plain steps are
    # all audited: its first ones), the data audit's copy a few ops more
    assert set(plain) == {plain[0]} and set(audited) == set(large_audited) == {audited[0]}
    assert 0 < audited[0] - plain[0] <= 8, (plain, audited)
    assert plain[0] < OPS_PER_BATCH_LIMIT, plain


# ----------------------------------------------------------------------------- the pieces


def test_ranks_agree_on_a_stop_every_few_steps_and_at_the_epochs_end():
    alone = StopRequest(distributed=False)
    assert all(alone.agrees_at(step, False) for step in range(1, 30))
    assert alone.steps_to_next_agreement(3, 100) == 1
    ranks = StopRequest(distributed=False)
    ranks.distributed = True  # the schedule only (no process group here)
    agreed = [step for step in range(1, 26) if ranks.agrees_at(step, step == 25)]
    assert agreed == [AGREE_EVERY, 2 * AGREE_EVERY, 25]
    assert ranks.steps_to_next_agreement(AGREE_EVERY, 100) == AGREE_EVERY
    assert ranks.steps_to_next_agreement(3, 100) == AGREE_EVERY - 3
    assert ranks.steps_to_next_agreement(AGREE_EVERY * 2, 23) == 3


def test_buffer_snapshot_is_taken_into_the_same_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    snapshot = BufferSnapshot(model)
    storages = [saved.data_ptr() for _, saved in snapshot.pairs]
    model(torch.randn(4, 2))
    before = [b.clone() for b in model.buffers()]
    assert snapshot.take(model) is snapshot
    assert [saved.data_ptr() for _, saved in snapshot.pairs] == storages
    model(torch.randn(4, 2))
    snapshot.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))


def test_the_summary_names_what_synchronised_outside_the_logging_steps():
    audit = SyncAudit()
    audit.syncs = [("step 2", "scalar read", "x"), ("step 4", "scalar read", "y")]
    audit.syncs += [("end", "host read", "z"), ("step 11", "scalar read", "w")]
    audit.cuda_warnings = [("step 3", "synchronizing"), ("step 8", "ok"), ("end", "ok")]
    audit.ops.update({"step 2": 5, "step 3": 5, "step 4": 9})
    result = AuditResult(audit, log_interval=4, steps=10)
    assert result.unexpected_syncs() == [("step 2", "scalar read", "x")]
    assert result.unexpected_cuda_warnings() == [("step 3", "synchronizing")]
    summary = result.summary()
    assert summary["syncs_per_window"] == {"step 2": 1, "step 4": 1, "end": 1, "step 11": 1}
    assert summary["unexpected_syncs"] == [("step 2", "scalar read", "x")]
    assert summary["unexpected_cuda_warnings"] == [("step 3", "synchronizing")]
    assert summary["ops_per_plain_step"][:2] == [5, 5]  # steps 2 and 3; step 4 logs


def test_a_non_blocking_copy_is_no_sync_whether_its_flag_is_positional_or_named(monkeypatch):
    """``copy_(src, True)`` passes non_blocking positionally (as the data audit's copy does): the
    auditor once counted it as a blocking device-to-host copy. Meta tensors stand in for the
    device's here."""
    from support import sync_audit

    monkeypatch.setattr(sync_audit, "_is_device", lambda t: t.device.type == "meta")
    host, device = torch.empty(2), torch.empty(2, device="meta")
    copy = torch.ops.aten.copy_.default
    assert sync_audit.sync_kind(copy, (host, device, True), {}) is None
    assert sync_audit.sync_kind(copy, (host, device), {"non_blocking": True}) is None
    for args in ((host, device), (host, device, False)):
        assert sync_audit.sync_kind(copy, args, {}) == "blocking device-to-host copy"


def test_a_tensor_made_in_another_thread_is_no_sync_and_a_real_scalar_read_is_one():
    """On CUDA a CPU tensor cannot make the host wait, wherever it was made (the decode thread
    clones its rows where the audit's mode does not see them); a scalar read of the device's
    tensor is counted, on CUDA and by origin on the CPU."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as thread:
        made = thread.submit(lambda: torch.arange(4.0)).result()
    on_cuda = SyncAudit(cuda=True)
    with on_cuda:
        float(made.max())
        with contextlib.suppress(NotImplementedError, RuntimeError):
            torch.empty(2, device="meta").sum().item()  # a device tensor's read
    assert [kind for _, kind, _ in on_cuda.syncs] == ["scalar read"]
    on_cpu = SyncAudit()
    weights = torch.ones(4)  # not from the loaded batch: the device's, by origin
    with on_cpu:
        float((weights * 2).sum())
    assert [kind for _, kind, _ in on_cpu.syncs] == ["scalar read"]

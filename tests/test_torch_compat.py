"""The private torch internals of torch_compat exist in the installed torch, and a missing one
is named in one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from imgtrainer import torch_compat
from imgtrainer.models import unwrap_model


def test_version_and_feature_checks():
    assert torch_compat.TORCH_VERSION >= (2, 5)
    assert torch_compat.torch_at_least(2, 5) and not torch_compat.torch_at_least(99, 0)
    assert torch_compat.fused_optimizer_kernels_exist(torch.device("cuda"))
    assert torch_compat.fused_optimizer_kernels_exist(torch.device("cpu"))
    assert not torch_compat.fused_optimizer_kernels_exist(torch.device("mps"))
    assert set(torch_compat.no_forward_buffer_sync()) <= {
        "forward_sync_buffers",
        "broadcast_buffers",
    }
    assert isinstance(torch_compat.dynamo_supported(), bool)


def test_the_foreach_kernels_do_what_their_names_say():
    a, b = [torch.zeros(2), torch.ones(3)], [torch.full((2,), 4.0), torch.full((3,), 3.0)]
    torch_compat.foreach_lerp_(a, b, [torch.tensor(0.5), torch.tensor(0.5)])
    assert a[0].tolist() == [2.0, 2.0] and a[1].tolist() == [2.0] * 3
    change = torch_compat.foreach_sub(b, a)
    torch_compat.foreach_mul_(change, torch.tensor(2.0))
    torch_compat.foreach_add_(a, change)
    assert a[0].tolist() == [6.0, 6.0] and a[1].tolist() == [4.0] * 3
    torch_compat.foreach_copy_(a, b)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_installed_torch_has_the_model_and_optimizer_internals():
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)  # lazy: nothing is compiled until the first call
    assert torch_compat.compiled_original(compiled) is model
    assert torch_compat.compiled_original(model) is model
    assert unwrap_model(compiled) is model

    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # the scale tensor is made at the first use
    assert torch_compat.grad_scale_on_device(scaler).item() == 8.0

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch_compat.set_scheduler_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_the_installed_torch_has_the_batch_norm_and_tensorboard_internals(tmp_path):
    assert torch_compat.is_batch_norm(nn.BatchNorm2d(2))
    assert torch_compat.is_batch_norm(nn.SyncBatchNorm(2))
    assert not torch_compat.is_batch_norm(nn.LayerNorm(2))
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        assert hasattr(torch_compat.summary_file_writer(writer), "add_summary")
    with pytest.raises(torch_compat.MissingTorchInternal, match="_get_file_writer"):
        torch_compat.summary_file_writer(object())


def test_the_installed_torch_has_the_ddp_internals(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        torch_compat.check_ddp_internals(ddp)
        assert isinstance(torch_compat.ddp_logging_data(ddp), dict)
    finally:
        dist.destroy_process_group()


def test_a_missing_internal_is_named_in_one_line():
    with pytest.raises(torch_compat.MissingTorchInternal) as err:
        torch_compat.require(
            "DistributedDataParallel",
            [(object(), "_gone", "ddp._gone"), (object(), "__class__", "ddp.__class__")],
            "the out-of-memory retry needs",
        )
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        f"torch {torch.__version__}'s DistributedDataParallel has no ddp._gone, "
        "which the out-of-memory retry needs"
    )
    assert isinstance(err.value, RuntimeError)


def test_tf32_and_autotuning_switches_are_put_back_as_they_were():
    """The resample's TF32 block and the policy's block without cuDNN autotuning change the
    global switches inside only, on this torch's own API (2.9 and later refuse a mix of the
    TF32 switches' old and new names)."""
    from imgtrainer import torch_compat

    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if torch_compat.torch_at_least(2, 9) else "allow_tf32"
    before = getattr(matmul, name)
    with torch_compat.tf32_matmuls():
        assert getattr(matmul, name) in ("tf32", True)
    assert getattr(matmul, name) == before
    torch.backends.cudnn.benchmark = True
    try:
        with torch_compat.cudnn_autotuning_off():
            assert torch.backends.cudnn.benchmark is False
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = False
    assert torch_compat.is_device_fault(RuntimeError("CUDA error: an illegal memory access"))
    assert not torch_compat.is_device_fault(RuntimeError("CUDA error: out of memory"))
    assert not torch_compat.is_device_fault(RuntimeError("nvjpeg: bad bitstream"))
    # torchvision's CUDA decoder words a sticky error without "CUDA error".
    assert torch_compat.is_device_fault(RuntimeError("Failed to synchronize CUDA stream: 700"))

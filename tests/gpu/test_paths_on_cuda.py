"""One tiny epoch through the real launcher per CUDA path: float16 with its GradScaler, bfloat16
without one, channels_last off, each --cache_images, --compile, NCCL at world size 2, and
--low_memory's peak within --max_memory_gb."""

from __future__ import annotations

import pytest
import torch

from support.folder_runs import RUN_SECONDS, expect_finished, launch, load_checkpoint

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,  # the launcher in a new interpreter
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TINY = ["--image_size", "32", "--batch_size", "16", "--epochs", "1", "--log_interval", "1"]
LOW_MEMORY_BUDGET_GB = 2.0


def test_float16_saves_its_grad_scaler(tiny_data, tmp_path):
    run = launch(tmp_path / "ws1_fp16", tiny_data, [*TINY, "--use_amp"])
    expect_finished(run, 1)
    state = load_checkpoint(run.latest).get("scaler_state_dict")
    assert state and state.get("scale"), "float16 run saved no GradScaler state"


def test_bfloat16_uses_no_grad_scaler(tiny_data, tmp_path):
    run = launch(tmp_path / "bf16", tiny_data, [*TINY, "--use_amp", "--amp_dtype", "bfloat16"])
    expect_finished(run, 1)
    assert not load_checkpoint(run.latest).get("scaler_state_dict"), "bfloat16 used a GradScaler"


@pytest.mark.parametrize(
    ("flags", "printed"),
    [
        pytest.param(["--no_channels_last"], "", id="channels_last_off"),
        pytest.param(["--cache_images", "gpu"], "decoded images in gpu", id="cache_gpu"),
        pytest.param(
            ["--cache_images", "ram"], "filled as the images are first read", id="cache_ram"
        ),
        pytest.param(["--cache_images", "none"], "", id="cache_none"),
    ],
)
def test_one_tiny_epoch_with_amp(tiny_data, tmp_path, flags, printed):
    run = launch(tmp_path / "run", tiny_data, [*TINY, "--use_amp", *flags])
    expect_finished(run, 1)
    assert printed in run.stdout, f"{printed!r} not in the output"


def test_compile(tiny_data, tmp_path):
    run = launch(
        tmp_path / "compile", tiny_data, [*TINY, "--use_amp", "--compile"], timeout=2 * RUN_SECONDS
    )
    expect_finished(run, 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_at_world_size_2(tiny_data, tmp_path):
    """NCCL at world size 2, with the host-side (gloo) agreement of --auto_micro_batch and
    --check_sync's comparison of the replicas."""
    flags = [*TINY, "--batch_size", "8", "--use_amp", "--auto_micro_batch", "--accum_steps", "2"]
    run = launch(tmp_path / "nccl_ws2", tiny_data, [*flags, "--check_sync"], gpus=2)
    expect_finished(run, 1)
    assert run.history().get("world_size") == 2


def test_low_memory_keeps_the_peak_within_max_memory_gb(photo_data, tmp_path):
    """--low_memory --max_memory_gb 2 at 224 px, batch 64, on photos: the peak allocated memory
    stays within the budget (bench/gpu_check.py's low_memory_224 measures it against the normal
    run, speed too)."""
    flags = ["--image_size", "224", "--batch_size", "64", "--epochs", "1", "--cache_images", "ram"]
    flags += ["--low_memory", "--max_memory_gb", str(LOW_MEMORY_BUDGET_GB)]
    run = launch(tmp_path / "low_memory", photo_data, flags)
    peak = expect_finished(run, 1)["peak MiB"]
    assert peak <= LOW_MEMORY_BUDGET_GB * 1024, (
        f"peak {peak:.0f} MiB is over the {LOW_MEMORY_BUDGET_GB} GiB budget"
    )

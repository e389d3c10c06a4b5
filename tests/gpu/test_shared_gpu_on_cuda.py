"""2 processes sharing one GPU over gloo through the real launcher, ``--num_gpus 2`` with
IMGTRAINER_SHARE_GPUS=1: every multi-rank CUDA path (DDP's all-reduce of CUDA gradients, the
metrics' reductions, the shared-out data checks) on a one-GPU machine, with each cache mode,
and once with a rank SIGKILLed mid-epoch, restarted by torchrun and resumed."""

from __future__ import annotations

import pytest
import torch

from conftest import kill_at
from imgtrainer.process import SHARE_GPUS_ENV
from support.folder_runs import expect_finished, kill_and_resume_problem, launch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,  # the launcher in a new interpreter
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHARED = {SHARE_GPUS_ENV: "1"}
SHARED_GPU_RUN = ["--image_size", "32", "--batch_size", "8", "--log_interval", "1", "--use_amp"]
# 96 images, 8 per process and step on 2 processes: 6 steps per epoch; rank 1 dies after step 5
# of epoch 2, the newest checkpoint is the one of step 4.
KILL_AT, RESUMED_AT = "2:5:1", "epoch 2, step 4 of 6"


@pytest.mark.parametrize(
    ("cache", "extra"),
    [
        pytest.param(
            "gpu",
            ["--amp_dtype", "bfloat16", "--auto_micro_batch", "--accum_steps", "2"],
            id="cache_gpu",
        ),
        pytest.param("ram", ["--check_sync"], id="cache_ram"),
        pytest.param("none", [], id="cache_none"),
    ],
)
def test_two_processes_share_one_gpu(tiny_data, tmp_path, cache, extra):
    flags = [*SHARED_GPU_RUN, "--epochs", "1", "--cache_images", cache, *extra]
    run = launch(tmp_path / f"shared_gpu_{cache}", tiny_data, flags, 2, env=SHARED)
    expect_finished(run, 1)
    assert run.history().get("world_size") == 2


def test_a_killed_rank_sharing_the_gpu_is_restarted_and_resumes(tiny_data, tmp_path):
    """Rank 1 SIGKILLed mid-epoch; torchrun restarts both, they resume from the step checkpoint,
    and the run ends with exit 0 and every epoch once."""
    flags = [*SHARED_GPU_RUN, "--epochs", "2", "--cache_images", "ram", "--save_every_steps", "2"]
    flags += ["--max_restarts", "1", "--resume", "auto"]
    env = {**SHARED, **kill_at(KILL_AT)}
    run = launch(tmp_path / "shared_gpu_kill_resume", tiny_data, flags, 2, env=env)
    expect_finished(run, 2)
    assert run.history().get("world_size") == 2
    assert kill_and_resume_problem(run, killed_rank=1, resumed_at=RESUMED_AT, epochs=2) == ""

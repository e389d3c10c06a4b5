"""Resume across devices (CPU to GPU and back) and after SIGTERM, bitwise, through the real
launcher."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from support.folder_runs import (
    RUN_SECONDS,
    checkpoint_differences,
    expect_finished,
    finish,
    launch,
    load_checkpoint,
    start,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,  # the launcher in a new interpreter
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TINY = ["--image_size", "32", "--batch_size", "16", "--epochs", "1", "--log_interval", "1"]
# 30 steps of 16 images per epoch: a checkpoint after step 5, then the signal, lands mid-epoch.
SIGTERM_RUN = ["--image_size", "112", "--batch_size", "16", "--use_amp", "--cache_images", "ram"]


@pytest.mark.parametrize(("first", "second"), [("cpu", "cuda"), ("cuda", "cpu")])
def test_resume_on_another_device(tiny_data, tmp_path, first, second):
    """One epoch on ``first``, a second resumed from its checkpoint on ``second``, both with
    --use_amp (fused AdamW and float16 + GradScaler on CUDA, bfloat16 on the CPU)."""
    flags = [*TINY, "--use_amp"]
    one = launch(tmp_path / f"resume_{first}_then", tiny_data, flags, device=first)
    expect_finished(one, 1)
    resumed = [*flags, "--epochs", "2", "--resume", str(one.latest)]
    two = launch(tmp_path / f"resume_then_{second}", tiny_data, resumed, device=second)
    expect_finished(two, 2)


def test_sigterm_then_resume_is_bitwise_the_uninterrupted_run(mid_data, tmp_path):
    """--deterministic: an uninterrupted run, and a run stopped by SIGTERM then resumed, end
    with bitwise equal weights and optimizer state."""
    flags = [*SIGTERM_RUN, "--epochs", "2", "--deterministic", "--save_every_steps", "5"]
    whole = launch(tmp_path / "deterministic_whole", mid_data, flags)
    expect_finished(whole, 2)

    started = time.monotonic()
    folder = tmp_path / "deterministic_stopped"
    process = start(folder, mid_data, flags)
    written = folder / "checkpoints" / "checkpoint_latest.pth"
    while process.poll() is None and not written.exists() and time.monotonic() - started < 210:
        time.sleep(0.01)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # what a scheduler's preemption sends
    stopped = finish(process, folder, started, RUN_SECONDS)
    assert stopped.returncode != 0 and stopped.latest.is_file(), (
        f"SIGTERM: exit code {stopped.returncode}, expected 143 and a checkpoint: {stopped.tail()}"
    )
    assert load_checkpoint(stopped.latest)["epoch"] < 2, "the run finished before SIGTERM arrived"

    resumed = launch(
        tmp_path / "deterministic_resumed", mid_data, [*flags, "--resume", str(stopped.latest)]
    )
    expect_finished(resumed, 2)
    compared, differ = checkpoint_differences(
        load_checkpoint(whole.latest), load_checkpoint(resumed.latest)
    )
    assert compared and not differ, (
        f"the resumed run differs from the uninterrupted one in {differ[:5]}"
    )

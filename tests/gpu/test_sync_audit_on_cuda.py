"""No host-device synchronisation between logging steps over 10 steps on CUDA, for each
--cache_images source, float16 (GradScaler) and bfloat16, with the EMA and the stop agreement:
tests/support/sync_audit.py's dispatch-mode audit and torch.cuda.set_sync_debug_mode("warn")
(tests/test_sync_audit.py runs the same audit on the CPU; bench/sync_audit.py writes a run's
figures and a profiler trace)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.harness import write_image_folder
from support.sync_audit import audit_run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CLASSES = ["cat", "dog", "fox"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """42 images: 10 steps of 4."""
    root = tmp_path_factory.mktemp("sync_cuda")
    train = write_image_folder(root / "train", CLASSES, 14, size=20, seed=1)
    return train, write_image_folder(root / "val", CLASSES, 2, size=20, seed=2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("source", ["gpu", "ram", "none"])
def test_no_sync_between_logging_steps_on_cuda(data, source, precision):
    result = audit_run(*data, source, 4, precision, device="cuda")
    assert result.steps == 10
    assert result.unexpected_syncs() == []
    assert result.unexpected_cuda_warnings() == []

"""--check_sync: replicas that drift apart are caught, naming the tensor and the ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from imgtrainer.distributed.collectives import check_ranks_in_sync
from imgtrainer.errors import UserError
from imgtrainer.models import build_model


def _worker(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = build_model("resnet18", 3)
        # The same two processes check identical replicas, then replicas that drifted apart.
        for case in ("identical", "drifted"):
            if case == "drifted" and rank == 1:
                with torch.no_grad():
                    model.layer2[0].conv1.weight[0, 0, 0, 0] += 1e-6
            try:
                check_ranks_in_sync(model)
                (out / f"{case}{rank}.txt").write_text("in sync")
            except UserError as err:
                (out / f"{case}{rank}.txt").write_text(str(err))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def messages(tmp_path_factory) -> dict[str, list[str]]:
    """What each rank's check said, per case: one pair of processes for both tests."""
    from imgtrainer.run.launcher import free_port

    out = tmp_path_factory.mktemp("check_sync")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    return {
        case: [(out / f"{case}{r}.txt").read_text() for r in (0, 1)]
        for case in ("identical", "drifted")
    }


@pytest.mark.slow
def test_identical_replicas_pass(messages):
    assert messages["identical"] == ["in sync", "in sync"]


@pytest.mark.slow
def test_a_drifted_rank_is_named_with_the_first_differing_tensor(messages):
    for message in messages["drifted"]:  # every rank stops, with the same one-line explanation
        assert "layer2.0.conv1.weight differs between rank 0 and rank(s) [1]" in message

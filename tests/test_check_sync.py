"""--check_sync: replicas that drift apart are caught, naming the tensor and the ranks."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from errors import UserError
from model import build_model
from train_ddp import check_ranks_in_sync


def _worker(rank: int, port: int, drift: bool, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = build_model("resnet18", 3)
        if drift and rank == 1:
            with torch.no_grad():
                model.layer2[0].conv1.weight[0, 0, 0, 0] += 1e-6
        try:
            check_ranks_in_sync(model)
            (out / f"rank{rank}.txt").write_text("in sync")
        except UserError as err:
            (out / f"rank{rank}.txt").write_text(str(err))
    finally:
        dist.destroy_process_group()


def run_check(tmp_path: Path, drift: bool) -> list[str]:
    from launch_ddp import free_port

    mp.spawn(_worker, args=(free_port(), drift, tmp_path), nprocs=2, join=True)
    return [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]


def test_identical_replicas_pass(tmp_path: Path):
    assert run_check(tmp_path, drift=False) == ["in sync", "in sync"]


def test_a_drifted_rank_is_named_with_the_first_differing_tensor(tmp_path: Path):
    messages = run_check(tmp_path, drift=True)
    for message in messages:     # every rank stops, with the same one-line explanation
        assert "layer2.0.conv1.weight differs between rank 0 and rank(s) [1]" in message

"""Validation is exact across ranks: 2 processes give the metrics of 1 on the same weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import FP32, ONE_CPU_PROCESS, data_config, write_image_folder
from imgtrainer.data.host.samplers import ShardSampler
from imgtrainer.data.loaders import LoaderSpec, build_datasets, make_loader
from imgtrainer.models import build_model
from imgtrainer.training.evaluation import EvalSettings, evaluate


def metrics_on_shard(val_dir: Path, rank: int, world_size: int) -> dict:
    cfg = data_config(
        val_dir,
        val_dir,
        image_size=16,
        seed=0,
        crop_scale_min=0.5,
        hflip=0.5,
        log_dir=str(val_dir.parent / f"logs_rank{rank}"),
    )
    _, val_set, classes, _ = build_datasets(cfg, ONE_CPU_PROCESS)
    torch.manual_seed(0)  # the same weights in every process
    model = build_model("resnet18", len(classes))
    loader = make_loader(
        val_set,
        ShardSampler(len(val_set), rank, world_size),
        LoaderSpec(batch_size=4, train=False),
    )
    return evaluate(model, loader, EvalSettings(torch.device("cpu"), FP32, None, False))


def _worker(rank: int, world_size: int, val_dir: Path, out: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = metrics_on_shard(val_dir, rank, world_size)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_match_one_on_an_odd_sized_val_set(tmp_path: Path):
    from imgtrainer.run.launcher import free_port

    val_dir = write_image_folder(tmp_path / "val", ["a", "b", "c"], per_class=5)  # 15 images
    single = metrics_on_shard(val_dir, rank=0, world_size=1)
    mp.spawn(_worker, args=(2, val_dir, tmp_path, free_port()), nprocs=2, join=True)
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert single["val_samples"] == 15
    for result in per_rank:  # every rank holds the global, all-reduced metrics
        assert result["val_samples"] == 15  # no padding counted, nothing missed
        for key in ("val_acc", "val_top5", "val_loss"):
            assert abs(result[key] - single[key]) < 1e-6, (key, result, single)


def test_shards_cover_every_index_once():
    for size, world in ((15, 2), (7, 4), (3, 5)):
        shards = [list(ShardSampler(size, r, world)) for r in range(world)]
        assert sorted(i for shard in shards for i in shard) == list(range(size))

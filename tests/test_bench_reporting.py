"""bench/throughput.py's step variants, JPEG decode rates and per-source summary, at tiny sizes
on the CPU (the GPU side runs in bench/gpu_check.py's jpeg_decode and step_variants checks)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from PIL import Image

from conftest import ONE_CPU_PROCESS, ROOT
from imgtrainer.config import parse_config


def throughput_module():
    spec = importlib.util.spec_from_file_location(
        "bench_throughput", ROOT / "bench" / "throughput.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_variants_scale_the_batch_and_swap_adamw_kernels():
    bench = throughput_module()
    flags = ["--image_size", "16", "--batch_size", "2", "--device", "cpu", "--model", "test_resnet"]
    cfg = parse_config(flags)
    doubled = bench.measure_ceiling(cfg, ONE_CPU_PROCESS, 1, 1, bench.STEP_VARIANTS["batch_x2"])
    assert doubled["batch_size"] == 4 and doubled["first_step_seconds"] > 0
    assert doubled["images_per_sec"] == pytest.approx(4 / doubled["step_seconds"])
    assert doubled["optimizer_kernels"] == ["fused"]  # the trainer's AdamW (fused on this torch)
    assert "tflops" not in doubled  # FLOP/s and the share of the peak: on CUDA only
    swapped = bench.measure_ceiling(
        cfg, ONE_CPU_PROCESS, 1, 1, bench.STEP_VARIANTS["adamw_foreach"]
    )
    assert swapped["batch_size"] == 2 and swapped["optimizer_kernels"] == ["foreach"]


def test_decode_rates_and_the_summary_table(tmp_path, capsys):
    bench = throughput_module()
    rng = np.random.default_rng(0)
    for i in range(6):
        folder = tmp_path / f"c{i % 2}"
        folder.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i}.jpg")
    rates = bench.decode_rates(tmp_path, "cpu")
    assert rates["images"] == 6 and rates["mean_kib"] > 0
    names = list(rates["rates"])
    assert names[0] == "cpu, 1 process" and names[1].startswith("cpu, ")
    assert all(r["images_per_sec"] > 0 for r in rates["rates"].values())
    bench.print_decode(rates)

    row = {
        "world_size": 1,
        "source": "ram",
        "ceiling": {"images_per_sec": 200.0},
        "trainer": {
            "images_per_sec": 150.0,
            "step_shares": {"data_wait": 0.25},
            "fraction_of_peak": 0.132,
        },
        "efficiency": 0.75,
    }
    bench.print_summary([row, {**row, "source": "none", "trainer": {**row["trainer"]}}])
    out = capsys.readouterr().out
    assert "JPEG decode (6 files" in out
    header, first = out.strip().splitlines()[-3:-1]
    assert (
        header.split()
        == "world source watchdog img/s ceiling trainer/ceiling data wait of bf16 peak".split()
    )
    assert first.split() == ["1", "ram", "-", "150.0", "200.0", "0.750", "25.0%", "13.2%"]


def test_policy_times_compare_the_loop_with_the_grouped_ops(capsys):
    bench = throughput_module()
    times = bench.policy_times(16, 4, "cpu", repeats=1)
    assert (times["device"], times["image_size"], times["batch_size"]) == ("cpu", 16, 4)
    for name in ("trivialaugment", "randaugment"):
        assert times[name]["per_image_ms"] > 0 and times[name]["grouped_ms"] > 0
    bench.print_policy(times)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "--auto_augment on a batch of 4 at 16 px (cpu), ms per batch"
    assert lines[1].split()[:3] == ["trivialaugment", "per", "image"]

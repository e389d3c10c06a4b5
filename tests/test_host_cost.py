"""bench/host_cost.py at batch 8 in this interpreter: every source and policy gets its row of
host milliseconds per step on meta tensors, next to the GPU budget."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import ROOT


def host_cost_module():
    spec = importlib.util.spec_from_file_location(
        "bench_host_cost", ROOT / "bench" / "host_cost.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_host_cost_prints_a_row_per_source_and_policy(capsys):
    bench = host_cost_module()
    flags = ["--batch_size", "8", "--image_size", "32", "--short_side", "40", "--repeats", "1"]
    assert bench.main(flags) == 0
    out = capsys.readouterr().out
    assert "Host cost per step on meta tensors" in out and "batch 8 at 32 px" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["ram"], ["gpu"], ["nvjpeg"])
    ]
    assert [(r[0], r[1]) for r in rows] == [
        (source, policy) for source in bench.SOURCES for policy in bench.POLICIES
    ]
    for row in rows:
        draws, augment, ops, step, step_ops, estimate = map(float, row[2:8])
        assert draws > 0 and augment > 0 and ops > 10 and step > 0 and step_ops > 100
        launches = (ops + step_ops) * bench.LAUNCH_US / 1000
        assert estimate == pytest.approx(launches, abs=0.02)  # the draws: in the workers
        assert row[-1] == "ms)" and row[-3] == "of"  # "(N% of 19 ms)"

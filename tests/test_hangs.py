"""A stuck process is named and the job goes on, through the real launcher with 2 CPU processes:
a rank frozen with SIGSTOP, then a loader worker frozen inside a file read, each named within
--hang_timeout and a small margin with its stacks, and the workers restarted from the newest
checkpoint; a slow rank named as a straggler without stopping the run; a rank frozen inside a
collective with no restart left ends the run with exit code 3 and the resume hint."""

from __future__ import annotations

import csv
import datetime
import json
import os
import re
from pathlib import Path

import pytest

from conftest import TINY_FLAGS, run_launcher, write_image_folder

pytestmark = pytest.mark.slow

HANG_TIMEOUT = 3.0
# The watcher polls every timeout/4; a contended machine adds a little.
MARGIN = 2.0
INJECTION = str(Path(__file__).parent / "fault_injection")


def hang_run(tmp_path: Path, env: dict[str, str], *flags: object):
    """60 images of 16 px, batch 2 on 2 processes (15 steps), loader workers, a checkpoint
    every 2 steps, --hang_timeout 3s; timm's small ResNet (0.4 M parameters: its steps and
    checkpoints cost a fraction of resnet18's; what hangs does not depend on the model)."""
    train = write_image_folder(tmp_path / "data" / "train", ["cat", "dog", "fox"], 20, seed=1)
    val = write_image_folder(tmp_path / "data" / "val", ["cat", "dog", "fox"], 2, seed=2)
    args = [
        *TINY_FLAGS, "--device", "cpu", "--nproc", 2, "--train_dir", train, "--val_dir", val,
        "--batch_size", 2, "--num_workers", 2, "--cache_images", "none", "--epochs", 1,
        "--save_every_steps", 2, "--hang_timeout", f"{HANG_TIMEOUT:g}s", "--model", "test_resnet",
        *flags,
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [INJECTION, os.environ.get("PYTHONPATH", "")]))
    return run_launcher(args, tmp_path, timeout=240, env={"PYTHONPATH": path, **env})


def stamps(path: Path, phrase: str) -> list[datetime.datetime]:
    """The times of the log lines of ``path`` that hold ``phrase``."""
    found = []
    for line in path.read_text().splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
        if match and phrase in line:
            found.append(datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f"))
    return found


def seconds(later: datetime.datetime, earlier: datetime.datetime) -> float:
    return (later - earlier).total_seconds()


def test_a_frozen_rank_then_a_frozen_loader_worker_are_named_and_restarted(tmp_path: Path):
    """Attempt 0 freezes rank 1 after step 3; attempt 1 freezes its loader worker 0 inside its
    6th file read; attempt 2 runs rank 1 slow (a straggler) and finishes."""
    env = {
        "TRAIN_DDP_FREEZE": "0:1:3:1:rank,1:1:6:1:worker",
        "TRAIN_DDP_SLOW": "2:0.4:1",
    }
    result = hang_run(tmp_path, env, "--max_restarts", 2)
    assert result.returncode == 0, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("watchdog: ")]
    assert len(lines) == 2, result.stderr
    assert re.match(
        r"watchdog: rank 1 \(host .+, pid \d+\) made no progress for \d s after global step 2, "
        r"phase forward-backward .*; stacks: logs/hang/attempt0-rank1\.txt; restarting the "
        r"workers from the newest checkpoint \(restart 1 of --max_restarts 2\)",
        lines[0],
    ), lines[0]
    assert re.search(
        r"phase data wait; its loader worker 0 \(pid \d+\) is stuck reading \S+/data/train/\w+/"
        r"img_\d+\.jpg; stacks: logs/hang/attempt1-rank1-worker0\.txt; restarting",
        lines[1],
    ), lines[1]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert not errors, result.stderr  # the rank waiting for the frozen one is not blamed
    hang = tmp_path / "logs" / "hang"
    for name, frame in [("attempt0-rank1.txt", "Freeze.on_step_end"), ("attempt1-rank1-worker0.txt", "reading")]:  # fmt: skip
        stacks = (hang / name).read_text()
        assert "state T" in stacks and frame in stacks and "===== rank 0" in stacks, stacks

    logs = tmp_path / "logs"
    frozen = stamps(logs / "train_rank_1.log", "TRAIN_DDP_FREEZE")
    named = stamps(logs / "torchrun.log", "made no progress")
    resumed = stamps(logs / "train_rank_1.log", "Resumed from")
    assert len(frozen) == len(named) == len(resumed) == 2
    timings = [
        (seconds(n, f), seconds(r, f)) for f, n, r in zip(frozen, named, resumed, strict=True)
    ]
    print(f"\nseconds from the freeze to the named line / to the restarted rank: {timings}")
    for to_named, to_resumed in timings:
        assert HANG_TIMEOUT - 0.2 < to_named < HANG_TIMEOUT + MARGIN
        assert to_named < to_resumed

    history = json.loads((logs / "training_history.json").read_text())
    assert [record["epoch"] for record in history["epochs"]] == [1]
    assert "straggler: rank 1 on host" in result.stdout + result.stderr
    with open(logs / "metrics.csv") as f:
        row = next(csv.DictReader(f))
    assert float(row["rank1_outside_step_s"]) > float(row["rank0_outside_step_s"])
    assert 0 <= float(row["rank1_data_wait_share"]) < 1


def test_a_rank_frozen_in_a_collective_without_restarts_ends_with_code_3(tmp_path: Path):
    # Frozen in step 4's checkpoint (its collectives), after the checkpoint of step 2.
    env = {"TRAIN_DDP_FREEZE": "0:1:4:1:collective"}
    result = hang_run(tmp_path, env, "--max_restarts", 0)
    assert result.returncode == 3, (result.stdout, result.stderr)
    line = next(line for line in result.stderr.splitlines() if line.startswith("watchdog: "))
    assert "watchdog: rank 1 (host " in line and "phase collective" in line, line
    assert "ending the run (--max_restarts 0: none left)" in line
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 (pid "), result.stderr
    assert "--resume auto" in errors[0] and "Traceback" not in result.stderr
    stacks = (tmp_path / "logs" / "hang" / "attempt0-rank1.txt").read_text()
    assert "all_reduce" in stacks or "all_gather" in stacks, stacks
    assert (tmp_path / "checkpoints" / "checkpoint_latest.pth").exists()
    frozen = stamps(tmp_path / "logs" / "train_rank_1.log", "TRAIN_DDP_FREEZE")[0]
    named = stamps(tmp_path / "logs" / "torchrun.log", "made no progress")[0]
    # The rank's last progress is its entry into the collective, just after its log line; the
    # SIGSTOP lands 0.5 s later, inside it.
    to_named = seconds(named, frozen)
    print(
        f"\nseconds from the last progress (0.5 s before the freeze) to the named line: {to_named:.1f}"
    )
    assert HANG_TIMEOUT - 0.2 < to_named < HANG_TIMEOUT + MARGIN

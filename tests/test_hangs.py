"""A stuck process is named and the job goes on, through the real launcher with 2 CPU processes:
the phase matrix (each process of a rank frozen with SIGSTOP at each moment where it exists:
the rank, a training or validation loader worker, a decode-check process; in a data wait of
the first or a later epoch, validation, a checkpoint's write, the decode check's end), each
named within --hang_timeout and a small margin of its rank's wait with its stacks, the workers
restarted from the newest checkpoint and the final weights those of an unfaulted run; a slow
rank named as a straggler without stopping the run; a rank frozen inside a collective with no
restart left ends the run with exit code 3 and the resume hint."""

from __future__ import annotations

import contextlib
import csv
import datetime
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import TINY_FLAGS, run_launcher, start_launcher, write_image_folder
from imgtrainer.events import LAUNCHER_EVENTS, read_events
from imgtrainer.reports.page.run_report import build_run_report
from support.harness import descendants

pytestmark = [pytest.mark.slow, pytest.mark.all_cores]

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


# ----------------------------------------------------------------------------- every phase frozen

# The phase matrix: each process of a rank frozen (SIGSTOP) at each moment where it exists. A
# run of 3 epochs of 8 steps (264 training images, batch 16 per process, a checkpoint every 2
# steps; 297 images in all, so that the decode check runs in a process of its own) hosts one
# frozen process per torchrun attempt, in the order of its positions; three such runs and an
# unfaulted one run side by side (their --hang_timeout waits overlap).
MOMENTS = ("first data wait", "later data wait", "validation", "checkpoint write", "check end")
WHO = {
    "rank": "the rank",
    "worker": "a training loader worker",
    "valworker": "a validation loader worker",
    "check": "a decode-check process",
}
CANNOT_HAPPEN = {
    ("valworker", "first data wait"): "the validation loader's workers start at the first "
    "validation (persistent from then on): none exists in the first epoch's data waits",
    ("valworker", "check end"): "the decode check ends before the first validation, when no "
    "validation loader worker exists yet",
    ("check", "later data wait"): "the decode check's processes end with the check, at the end "
    "of the first epoch (of an attempt) and before its validation",
    ("check", "validation"): "the decode check's processes end with the check, before the "
    "first validation",
}
STEPS, EPOCHS, EVERY = 8, 3, 2


@dataclass(frozen=True)
class Cell:
    """One frozen process: ``who`` at ``moment``, by $TRAIN_DDP_FREEZE's EPOCH:STEP:RANK:WHERE
    (its attempt is its place in its run); the phase its rank is stuck in and the process
    named then."""

    who: str
    moment: str
    freeze: str
    stuck: str  # the phase words of the named line
    named: str  # what the line names besides the rank: "", or "its ... worker 0"

    @property
    def rank(self) -> int:
        return int(self.freeze.split(":")[2])


DATA, VALIDATION, CHECK = "data wait", "validation", "waiting for the images' decode check"
RUNS = {
    "ranks": [
        Cell("rank", "first data wait", "1:3:1:rank@data", DATA, ""),
        Cell("rank", "check end", "1:8:1:rank@check", CHECK, ""),
        Cell("rank", "validation", "1:8:1:rank@validation", VALIDATION, ""),
        # A rank frozen at a later epoch's data wait, the other one waiting in its backward:
        # its validation loader's workers exist beside its training loader's (issue 37).
        Cell("valworker", "later data wait", "2:3:1:valworker@data", VALIDATION,
             "its validation loader worker"),
        Cell("rank", "later data wait", "3:0:1:rank@data", DATA, ""),
        Cell("rank", "checkpoint write", "3:4:0:rank@write", "checkpoint", ""),
    ],
    "workers": [
        # Stuck inside its 56th read (its fourth batch, the seventh of the epoch: asked for
        # once the rank took the third, after step 2's checkpoint). A batch it queued earlier
        # is still fetched from it (its storage's file descriptor): the rank may wait there.
        Cell("worker", "first data wait", "1:56:1:worker", DATA, "its loader worker"),
        Cell("check", "check end", "1:8:1:check@check", CHECK, "its decode-check process"),
        Cell("worker", "check end", "1:8:1:worker@check", DATA, "its loader worker"),
        Cell("worker", "checkpoint write", "2:2:1:worker@checkpoint", DATA,
             "its loader worker"),
        Cell("worker", "validation", "2:8:1:worker@validation", DATA, "its loader worker"),
    ],
    "checks": [
        Cell("check", "checkpoint write", "1:2:1:check@checkpoint", CHECK,
             "its decode-check process"),
        Cell("check", "first data wait", "1:7:1:check@data", CHECK, "its decode-check process"),
        Cell("valworker", "checkpoint write", "2:2:1:valworker@checkpoint", VALIDATION,
             "its validation loader worker"),
        # A training loader worker frozen at a later epoch's data wait, the validation loader's
        # workers beside it: the launcher's watchdog thread died here (issue 37).
        Cell("worker", "later data wait", "3:0:1:worker@data", DATA, "its loader worker"),
        # Stuck inside its first read, at the first validation of the attempt.
        Cell("valworker", "validation", "3:1:1:valworker", VALIDATION,
             "its validation loader worker"),
    ],
}  # fmt: skip


def test_the_phase_matrix_is_complete():
    """Each (process, moment) is frozen once, or says why it cannot happen."""
    frozen = [(cell.who, cell.moment) for cells in RUNS.values() for cell in cells]
    assert len(frozen) == len(set(frozen))
    assert set(frozen) | set(CANNOT_HAPPEN) == {(w, m) for w in WHO for m in MOMENTS}
    assert not set(frozen) & set(CANNOT_HAPPEN)


def matrix_data(root: Path) -> tuple[Path, Path]:
    classes = ["cat", "dog", "fox"]
    return (
        write_image_folder(root / "train", classes, 88, seed=1),
        write_image_folder(root / "val", classes, 11, seed=2),
    )


def matrix_flags(train: Path, val: Path, restarts: int) -> list[object]:
    return [
        *TINY_FLAGS, "--device", "cpu", "--nproc", 2, "--train_dir", train, "--val_dir", val,
        "--batch_size", 16, "--num_workers", 2, "--cache_images", "none", "--epochs", EPOCHS,
        "--save_every_steps", EVERY, "--hang_timeout", f"{HANG_TIMEOUT:g}s",
        "--model", "test_resnet", "--max_restarts", restarts,
    ]  # fmt: skip


def freeze_env(cells: list[Cell]) -> dict[str, str]:
    spec = ",".join(f"{attempt}:{cell.freeze}" for attempt, cell in enumerate(cells))
    path = os.pathsep.join(filter(None, [INJECTION, os.environ.get("PYTHONPATH", "")]))
    return {"TRAIN_DDP_FREEZE": spec, "PYTHONPATH": path}


POSITION = re.compile(r"epoch (\d+), step (\d+)")


def held_since(logs: Path, rank: int, before: datetime.datetime) -> tuple[datetime.datetime, str]:
    """When the rank began the wait it was named in (its last freeze or wait line of the
    fault injection before ``before``), and that line."""
    lines = []
    for name in ("train_rank_0.log", "train_rank_1.log"):
        for line in (logs / name).read_text().splitlines():
            if "TRAIN_DDP_FREEZE" in line and f"rank {rank} " in line:
                when = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                if when <= before:
                    lines.append((when, line))
    return max(lines)


def newest_checkpoint(line: str) -> tuple[int, int]:
    """The position of the newest checkpoint when the rank was held at ``line``'s position:
    every EVERY steps within an epoch, and at its end (epoch E+1, step 0); a rank held in or
    before a checkpoint's write has not written it."""
    match = POSITION.search(line)
    if match is None:  # a worker stopped inside a read: its rank waits at the next batch
        return None
    epoch, step = int(match[1]), int(match[2])
    if step == STEPS or "write" in line:
        step -= 1
    return epoch, step - step % EVERY


@pytest.mark.slow
def test_every_process_frozen_at_every_moment_is_named_and_restarted(tmp_path: Path):
    """The phase matrix (``RUNS``, ``CANNOT_HAPPEN``) through the real launcher: each frozen
    process is named within --hang_timeout and a margin of its rank's wait, with its stacks,
    and the workers restart from the newest checkpoint; each run trains every epoch once and
    ends with the weights of the unfaulted run, bit for bit."""
    train, val = matrix_data(tmp_path / "data")
    started = time.monotonic()
    runs = {}
    try:
        for name, cells in [("unfaulted", []), *RUNS.items()]:
            (tmp_path / name).mkdir()
            env = freeze_env(cells) if cells else {}
            if name == "ranks":  # its last attempt (6 steps) runs rank 1 slow: a straggler,
                # slower than rank 0's data waits when the four runs share two cores
                env["TRAIN_DDP_SLOW"] = f"{len(cells)}:0.8:1"
            flags = matrix_flags(train, val, len(cells))
            runs[name] = start_launcher(flags, tmp_path / name, env)
        results = {name: run.communicate(timeout=600) for name, run in runs.items()}
    finally:
        for run in runs.values():
            end_with_descendants(run)
    print(f"\nthe matrix's {len(runs)} runs side by side: {time.monotonic() - started:.0f} s")
    for name, run in runs.items():
        assert run.returncode == 0, (name, results[name][1][-4000:])
    unfaulted = tmp_path / "unfaulted" / "checkpoints" / "checkpoint_latest.pth"
    reference = torch.load(unfaulted, weights_only=True)
    rows = []
    for name, cells in RUNS.items():
        rows += check_matrix_run(tmp_path / name, cells, results[name][1], reference)
    print("\n".join(rows))
    logs = tmp_path / "ranks" / "logs"
    assert "straggler: rank 1 on host" in (logs / "train_rank_0.log").read_text()
    with open(logs / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["rank1_outside_step_s"]) > float(last["rank0_outside_step_s"])
    assert 0 <= float(last["rank1_data_wait_share"]) < 1


def end_with_descendants(run) -> None:
    """A launcher still running (a test that failed): it and all it started, killed."""
    if run.poll() is None:
        for pid in [*descendants(run.pid), run.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.wait()


def check_matrix_run(workdir: Path, cells: list[Cell], stderr: str, reference: dict) -> list[str]:
    """Each cell's named line, stacks and restart; every epoch once; the final weights."""
    logs = workdir / "logs"
    lines = [line for line in stderr.splitlines() if line.startswith("watchdog: ")]
    assert len(lines) == len(cells), (workdir.name, stderr[-4000:])
    assert not [line for line in stderr.splitlines() if "error" in line], stderr[-4000:]
    named = stamps(logs / "torchrun.log", "made no progress")
    resumed = stamps(logs / "train_rank_0.log", "Resumed from")
    resumes = [
        line
        for line in (logs / "train_rank_0.log").read_text().splitlines()
        if "Resumed from" in line
    ]
    assert len(named) == len(resumed) == len(cells), workdir.name
    rows = []
    for attempt, cell in enumerate(cells):
        line = lines[attempt]
        part = rf"; {cell.named} \d+ \(pid \d+\) is stuck" if cell.named else r"; stacks: "
        assert re.search(
            rf"^watchdog: rank {cell.rank} \(host .+, pid \d+\) made no progress for \d+ s after "
            rf"global step \d+, phase {re.escape(cell.stuck)}{part}",
            line,
        ), (cell, line)
        assert f"restart {attempt + 1} of --max_restarts {len(cells)}" in line, line
        stacks = Path(workdir / re.search(r"stacks: ([^;\s]+)", line)[1]).read_text()
        assert "state T" in stacks.split("=====")[1] and "===== rank 0" in stacks, stacks[:2000]
        held, held_line = held_since(logs, cell.rank, named[attempt])
        to_named, to_resumed = seconds(named[attempt], held), seconds(resumed[attempt], held)
        # A stopped worker logs its line just after its read's start.
        assert HANG_TIMEOUT - 0.5 < to_named < HANG_TIMEOUT + MARGIN, (cell, held_line, to_named)
        assert to_named < to_resumed, cell
        expected = newest_checkpoint(held_line)
        if expected is not None:
            assert f": epoch {expected[0]}, step {expected[1]} of {STEPS} " in resumes[attempt], (
                cell,
                held_line,
                resumes[attempt],
            )
        rows.append(
            f"{WHO[cell.who]:28} {cell.moment:17} named {to_named:4.1f} s, restarted "
            f"{to_resumed:4.1f} s after its rank's wait began ({cell.freeze})"
        )
    history = json.loads((logs / "training_history.json").read_text())
    assert [record["epoch"] for record in history["epochs"]] == list(range(1, EPOCHS + 1))
    final = torch.load(workdir / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    for key in ("model_state_dict", "optimizer_state_dict"):
        assert_bitwise(final[key], reference[key], f"{workdir.name}: {key}")
    return rows


def assert_bitwise(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


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
    # The verdict as the launcher's event, on the run's page (built afterwards, as --report).
    hangs = [e for e in read_events(tmp_path / "logs" / LAUNCHER_EVENTS) if e["kind"] == "hang"]
    assert [(e["rank"], e["attempt"], e["text"]) for e in hangs] == [(1, 0, line)]
    assert "The hang watchdog acted 1 time(s)" in build_run_report(tmp_path / "logs")
    frozen = stamps(tmp_path / "logs" / "train_rank_1.log", "TRAIN_DDP_FREEZE")[0]
    named = stamps(tmp_path / "logs" / "torchrun.log", "made no progress")[0]
    # The rank's last progress is its entry into the collective, just after its log line; the
    # SIGSTOP lands once it waits inside it (the other rank enters it after).
    to_named = seconds(named, frozen)
    print(f"\nseconds from the last progress (the freeze) to the named line: {to_named:.1f}")
    assert HANG_TIMEOUT - 0.2 < to_named < HANG_TIMEOUT + MARGIN

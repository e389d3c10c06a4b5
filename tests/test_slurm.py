"""examples/slurm_train.sbatch under a real SLURM (tests/slurm_cluster.py: slurmctld + slurmd
on localhost), on the CPU: at its time limit and when preempted, the job stops with a
checkpoint, requeues itself, resumes and trains every epoch once.

The real script is submitted; sbatch options on the command line adapt it to one CPU node
(they win over its #SBATCH lines) and the flags after it reach the launcher (they win over the
script's). Both scenarios run at once on the node's 2 CPUs, so SLURM's 30 s time-limit check
costs no extra wait. The first start of each job holds after step HOLD_STEP
(fault_injection/slurm_hold.py) until its stop signal comes, so the signal always finds it
training, however slow the machine:

- time limit: SLURM sends the script's own ``--signal=B:USR1@120`` warning. The job is
  submitted with 10 minutes; at the hold the test shortens its limit (``scontrol update
  TimeLimit``, as an administrator may) so that the warning comes at SLURM's next check (every
  30 s), and sets 10 minutes again once the job is requeued, for the resumed start to finish;
- preemption: ``scancel --signal=TERM`` (the steps only, as a preemption's grace period does).

The cluster's AuthInfo ``cred_expire=5`` shortens SLURM's requeue delay from 2 minutes to 6 s.
Skipped where SLURM cannot start (not root, not installed: ``.ci/install-slurm``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import ROOT, tiny_run_flags, write_tiny_dataset
from slurm_cluster import ENDED, SlurmCluster, free_port, why_not

pytestmark = pytest.mark.slow

SBATCH = ROOT / "examples" / "slurm_train.sbatch"
FAULTS = Path(__file__).parent / "fault_injection"
BATCH = 16  # 48 training images: 3 steps per epoch
STEPS = 3
HOLD_STEP = 1
JOB_TIMEOUT_S = 240
# The states of a job that requeues itself once, in order ((state, restarts); others between).
REQUEUED_ONCE = [("RUNNING", 0), ("PENDING", 1), ("RUNNING", 1), ("COMPLETED", 1)]


@dataclass
class Job:
    """One submitted scenario and what the test saw of it."""

    name: str
    folder: Path
    id: str = ""
    submitted: float = 0.0
    seen: list[tuple[str, int, str, float]] = field(
        default_factory=list
    )  # state, restarts, reason, s
    events: dict[str, float] = field(default_factory=dict)  # seconds after submission
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def at(self, event: str) -> None:
        self.events.setdefault(event, round(time.monotonic() - self.submitted, 1))

    @property
    def output(self) -> str:
        path = self.folder / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else "(no output file)"

    def states(self) -> list[tuple[str, int]]:
        return [(state, restarts) for state, restarts, _, _ in self.seen]


@pytest.fixture(scope="module")
def cluster():
    reason = why_not()
    if reason:
        pytest.skip(reason)
    slurm = SlurmCluster(cpus=2)
    try:
        slurm.start()
    except (OSError, RuntimeError) as err:
        slurm.stop()
        pytest.skip(f"SLURM cannot start here: {err}")
    yield slurm
    slurm.stop()


def submit(cluster: SlurmCluster, job: Job, data: tuple[Path, Path]) -> None:
    """The example script on one CPU of the node, 2 epochs of the tiny dataset."""
    job.folder.mkdir(parents=True)
    env = {
        # The job's `python` is this one; its first start holds (slurm_hold.py).
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
        "IMGTRAINER_HOOKS": "slurm_hold:hold_first_start",
        "SLURM_TEST_HOLD": f"{HOLD_STEP}:{job.folder / 'held'}",
        "PYTHONUNBUFFERED": "1",
    }
    sbatch_options = [
        "--parsable",
        f"--job-name={job.name}",
        "--nodes=1",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--time=10",
        f"--output={job.folder}/slurm-%j.out",
    ]
    launcher_flags = [
        *("--device", "cpu", "--nproc", "1", "--no_use_amp"),
        *("--rdzv_endpoint", f"127.0.0.1:{free_port()}"),
        *tiny_run_flags(*data),
        *("--global_batch_size", BATCH, "--batch_size", BATCH),
        *("--epochs", "2", "--save_every_steps", "1000"),
        # timm's small ResNet: the requeued start trains the rest in a few seconds.
        *("--model", "test_resnet"),
        *("--checkpoint_dir", job.folder / "checkpoints", "--log_dir", job.folder / "logs"),
    ]
    job.submitted = time.monotonic()
    result = cluster.command("sbatch", *sbatch_options, SBATCH, *launcher_flags, env=env, cwd=ROOT)
    job.id = result.stdout.strip().split(";")[0]


def follow(
    cluster: SlurmCluster,
    job: Job,
    on_hold: Callable[[Job], None],
    on_requeued: Callable[[Job], None] = lambda job: None,
) -> None:
    """Poll the job every 0.1 s until it ends: record each change of (state, restarts, reason)
    and act at the hold and at the requeue."""
    try:
        while time.monotonic() - job.submitted < JOB_TIMEOUT_S:
            info = cluster.job(job.id)
            state, restarts = info.get("JobState", "?"), int(info.get("Restarts", "0"))
            reason = info.get("Reason", "")
            now = round(time.monotonic() - job.submitted, 1)
            if not job.seen or job.seen[-1][:3] != (state, restarts, reason):
                job.seen.append((state, restarts, reason, now))
            if (job.folder / "held").exists() and "held" not in job.events:
                job.at("held")
                on_hold(job)
            if restarts == 1 and state == "PENDING" and "requeued" not in job.events:
                job.at("requeued")
                on_requeued(job)
            if restarts == 1 and state == "RUNNING":
                job.at("running again")
            if state in ENDED:
                job.at("ended")
                return
            time.sleep(0.1)
        job.error = TimeoutError(f"job {job.id} still {job.seen[-1]} after {JOB_TIMEOUT_S} s")
    except BaseException as err:  # noqa: BLE001 - reported by the test that waits on it
        job.error = err


def run_time_s(cluster: SlurmCluster, job: Job) -> int:
    hours, minutes, seconds = (int(p) for p in cluster.job(job.id)["RunTime"].split(":")[-3:])
    return hours * 3600 + minutes * 60 + seconds


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory) -> dict[str, Job]:
    """Both scenarios, submitted together and followed in threads."""
    root = tmp_path_factory.mktemp("slurm_jobs")
    data = write_tiny_dataset(root)

    def time_limit_now(job: Job) -> None:
        # TimeLimit is in minutes: 60-120 s left, within the script's 120 s warning, so
        # SLURM's next 30 s check sends SIGUSR1 to the batch shell.
        minutes = run_time_s(cluster, job) // 60 + 2
        cluster.command("scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}")

    def time_limit_back(job: Job) -> None:
        cluster.command("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")

    def preempt(job: Job) -> None:
        cluster.command("scancel", "--signal=TERM", job.id)

    scenarios = {
        "time_limit": (Job("time_limit", root / "time_limit"), time_limit_now, time_limit_back),
        "preemption": (Job("preemption", root / "preemption"), preempt, lambda job: None),
    }
    for job, on_hold, on_requeued in scenarios.values():
        submit(cluster, job, data)
        job.thread = threading.Thread(
            target=follow, args=(cluster, job, on_hold, on_requeued), daemon=True
        )
        job.thread.start()
    return {name: job for name, (job, _, _) in scenarios.items()}


def finished(job: Job) -> Job:
    job.thread.join(JOB_TIMEOUT_S + 30)
    print(f"\n{job.name}: job {job.id}, events (s after sbatch): {job.events}")
    print(
        f"{job.name}: states seen: {' -> '.join(f'{s}({r}, {why})' for s, r, why, _ in job.seen)}"
    )
    if job.error is not None:
        raise AssertionError(f"{job.error}\n{job.output}") from job.error
    return job


def is_subsequence(wanted: list, seen: list) -> bool:
    items = iter(seen)
    return all(any(item == want for item in items) for want in wanted)


def assert_stopped_requeued_resumed(cluster: SlurmCluster, job: Job, stop_line: str) -> None:
    """The first start stopped with a checkpoint where it held, the job requeued itself once,
    and the second start resumed there and trained the rest: every epoch once."""
    out = job.output
    assert job.seen[-1][:2] == ("COMPLETED", 1), (job.seen, out)
    assert is_subsequence(REQUEUED_ONCE, job.states()), (job.seen, out)
    # SLURM's own record of each start: the requeued one ended with the launcher's 143.
    records = cluster.completion_records(job.id)
    print(
        f"{job.name}: job completion log: "
        + "; ".join(
            f"{r['JobState']} {r['StartTime']}..{r['EndTime']} exit {r['DerivedExitCode']}"
            for r in records
        )
    )
    assert [r["JobState"] for r in records][-1:] == ["COMPLETED"] and len(records) == 2, records
    assert stop_line in out, out
    stopped = re.search(r"Stopped at epoch 1, step (\d+); checkpoint saved to (\S+)\. Resume", out)
    assert stopped and int(stopped[1]) >= HOLD_STEP, out
    assert f"requeueing job {job.id} after its start 1" in out, out
    assert f"Resumed from {stopped[2]}: epoch 1, step {stopped[1]} of {STEPS}" in out, out
    assert "Done: " in out and "Traceback" not in out, out
    history = json.loads((job.folder / "logs" / "training_history.json").read_text())
    assert [record["epoch"] for record in history["epochs"]] == [1, 2], out


def test_at_its_time_limit_the_job_stops_with_a_checkpoint_requeues_and_finishes(cluster, jobs):
    job = finished(jobs["time_limit"])
    assert_stopped_requeued_resumed(cluster, job, "SIGUSR1: stopping the run with a checkpoint")


def test_preempted_with_sigterm_the_job_stops_with_a_checkpoint_requeues_and_finishes(
    cluster, jobs
):
    job = finished(jobs["preemption"])
    assert_stopped_requeued_resumed(
        cluster, job, "the launchers stopped on a signal to the job's steps"
    )

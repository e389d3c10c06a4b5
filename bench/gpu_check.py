#!/usr/bin/env python
"""GPU self-check: every CUDA path of the trainer, end to end, on generated data, in one command.

    python bench/gpu_check.py                       # everything; table on screen + JSON
    python bench/gpu_check.py --only bf16,compile   # some checks only
    python bench/gpu_check.py --only step_variants --seconds 570   # torch.compile modes etc.
    python bench/gpu_check.py --work_dir /tmp/gc    # keep every run's logs and checkpoints

Each check runs the real launcher (``python launch_ddp.py --device cuda --num_gpus N ...``) in
its own fresh checkpoint and log folders, and inspects what the run wrote (exit code, history,
checkpoints). Checks are isolated: one failing (or this script's own check code raising) does
not stop the others. The functional checks run a few at a time (they are small); the
measurements (memory, throughput) run alone afterwards, so their figures are not shared with
other work. The whole took about 9 minutes on one H100 (16 cores) with --jobs 6.

Covered: NCCL at world size 1 (and 2 with two GPUs visible); 2 processes sharing one GPU over
gloo through ``--num_gpus 2`` (``IMGTRAINER_SHARE_GPUS=1``), with AMP, each cache mode, and a
rank SIGKILLed mid-epoch then restarted by torchrun and resumed; --use_amp with float16 +
GradScaler and with bfloat16; channels_last on and off; --cache_images gpu, ram and none;
--compile; --low_memory --max_memory_gb 2 --batch_size 64 at 224 px against the normal run
(peak allocated memory, speed); resume CPU -> GPU and GPU -> CPU; SIGTERM then resume with
--deterministic, bitwise equal to an uninterrupted run; the CUDA tests (``pytest -k cuda``: the
tests marked ``cuda`` and the test_cuda_* ones); throughput at 224 px with bfloat16 AMP and
channels_last (bench/throughput.py's workers, batch 256): images/s, achieved TFLOP/s (ResNet18:
3.64 GFLOPs (1.82 G multiply-adds) forward per image, x3 for forward and backward) and the fraction of the device's
dense bf16 peak, trainer/ceiling efficiency for each cache mode (and the source auto chose),
time to first step, on photo-like JPEGs of mixed aspect (500 px and more, both orientations, 16:9
among them, one 4:1 panorama; bench/harness.py's write_photo_folder, written once per call).

Without CUDA it prints one line saying nothing was checked and exits 0. Exit code 1 when a check
failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support/: what the tests and the benchmarks share

from support import harness  # noqa: E402
from support.harness import descendants  # noqa: E402

RESNET18_FWD_FLOPS_224 = 3.64e9  # per image: 1.82 G multiply-adds, 2 FLOPs each; training counts forward + backward as 3x
# Dense bf16 tensor-core peaks in TFLOP/s, by a fragment of torch.cuda.get_device_name();
# the first fragment found wins, so the specific names come first.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)
TOTAL_SECONDS = 420.0  # checks not started by then are skipped: the whole run ends within ~9 min
RUN_SECONDS = 240.0  # one launcher run, at most (--compile: twice that)
LOW_MEMORY_BUDGET_GB = 2.0


class CheckFailed(Exception):
    """A check ran and found something wrong; ``figures`` are what it measured anyway."""

    def __init__(self, message: str, figures: dict[str, Any] | None = None):
        super().__init__(message)
        self.figures = figures or {}


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], dict[str, Any]]  # returns figures, raises CheckFailed
    measurement: bool = False  # runs alone, after the functional checks
    gpus: int = 1  # GPUs it needs
    default: bool = True  # False: only when named in --only (too long for the whole run)


@dataclass
class Result:
    name: str
    status: str  # pass, FAIL, ERROR (the check's own bug), skip
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


@dataclass
class Context:
    """What every check may use: a work folder, the device, generated data, the deadline."""

    work: Path
    gpus: int
    gpu_name: str
    deadline: float
    device: str = "cuda"  # "cpu" only in the tests of this script's own logic
    data: dict[str, Path] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    outputs: Path | None = None  # where files to keep go (profiler traces): --output's folder

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


# ----------------------------------------------------------------------------- running checks


def run_checks(
    checks: Sequence[Check],
    ctx: Context,
    jobs: int = 4,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run the functional checks ``jobs`` at a time, then the measurements one by one. Each
    check is isolated: whatever it raises becomes its own result. Results keep the list's
    order."""
    results: dict[str, Result] = {}

    def one(check: Check) -> None:
        result = run_one(check, ctx)
        results[check.name] = result
        if on_result is not None:
            on_result(result)

    functional = [c for c in checks if not c.measurement]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, functional))
    for check in checks:
        if check.measurement:
            one(check)
    return [results[c.name] for c in checks]


def run_one(check: Check, ctx: Context) -> Result:
    started = time.monotonic()
    if check.gpus > ctx.gpus:
        return Result(
            check.name, "skip", 0.0, detail=f"needs {check.gpus} GPUs, {ctx.gpus} visible"
        )
    if ctx.seconds_left() < 20:
        return Result(check.name, "skip", 0.0, detail="out of time")
    try:
        figures = check.run(ctx)
        return Result(check.name, "pass", time.monotonic() - started, figures)
    except CheckFailed as err:
        return Result(check.name, "FAIL", time.monotonic() - started, err.figures, str(err))
    except BaseException as err:  # noqa: BLE001 - isolation: any error is this check's result
        if isinstance(err, KeyboardInterrupt):
            raise
        return Result(
            check.name,
            "ERROR",
            time.monotonic() - started,
            detail=f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}",
        )


def format_figures(figures: dict[str, Any]) -> str:
    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    return ", ".join(f"{key} {fmt(value)}" for key, value in figures.items())


def format_table(results: Sequence[Result]) -> str:
    """check | status | seconds | figures, and under a failed check its first detail line."""
    width = max([len("check")] + [len(r.name) for r in results])
    lines = [
        f"{'check':<{width}}  {'status':<6}  {'time':>6}  figures",
        f"{'-' * width}  {'-' * 6}  {'-' * 6}  {'-' * 40}",
    ]
    for r in results:
        lines.append(
            f"{r.name:<{width}}  {r.status:<6}  {r.seconds:>5.0f}s  {format_figures(r.figures)}"
        )
        if r.status != "pass" and r.detail:
            lines.append(f"{'':<{width}}  -> {r.detail.splitlines()[0][:200]}")
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "FAIL", "ERROR", "skip")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no checks")
    return "\n".join(lines)


def build_report(results: Sequence[Result], ctx: Context, seconds: float) -> dict[str, Any]:
    return {
        "device": ctx.gpu_name,
        "gpus": ctx.gpus,
        "seconds": round(seconds, 1),
        "versions": versions(),
        "passed": all(r.status in ("pass", "skip") for r in results),
        "results": [vars(r) for r in results],
    }


def versions() -> dict[str, str]:
    import platform

    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }


# ----------------------------------------------------------------------------- data


DATASETS = {  # kind: (classes, training and validation images per class, side, photos)
    "tiny": (3, 32, 8, 40, False),  # 96 training images of 40 px
    "mid": (3, 160, 16, 128, False),  # 480 images of 128 px: 30 steps of 16 per epoch
    # 5400 mixed-aspect photos, short side 500-625 px (16:9 both ways, one 4:1 panorama), for
    # 224 px crops: the measurements (memory, throughput, decoding), as real photos load
    "photos": (10, 540, 54, 500, True),
}


def dataset(ctx: Context, kind: str) -> Path:
    """The generated data set ``kind`` (DATASETS), written once per call of this script and
    reused by every check that asks for it (checks running at once share it)."""
    with ctx.lock:
        if kind not in ctx.data:
            classes, train, val, side, photos = DATASETS[kind]
            root = ctx.work / f"data_{kind}"
            ctx.data[kind] = harness.write_split_folder(
                root, classes, train, val, side, photos=photos, threads=min(16, os.cpu_count() or 1)
            )
        return ctx.data[kind]


# ----------------------------------------------------------------------------- launcher runs


@dataclass
class Run:
    folder: Path
    returncode: int
    seconds: float
    stdout: str
    stderr: str

    @property
    def latest(self) -> Path:
        return self.folder / "checkpoints" / "checkpoint_latest.pth"

    def history(self) -> dict[str, Any]:
        path = self.folder / "logs" / "training_history.json"
        return json.loads(path.read_text()) if path.is_file() else {"epochs": []}

    def tail(self, chars: int = 600) -> str:
        text = (self.stderr.strip() or self.stdout.strip())[-chars:]
        return text.replace("\n", " | ")


def launcher_command(
    ctx: Context,
    folder: Path,
    data: Path,
    flags: Sequence[str],
    gpus: int = 1,
    device: str | None = None,
) -> list[str]:
    device = device or ctx.device
    placement = ["--num_gpus", str(gpus)] if device == "cuda" else ["--nproc", str(gpus)]
    return harness.launcher_command(
        "--device",
        device,
        *placement,
        "--train_dir",
        str(data / "train"),
        "--val_dir",
        str(data / "val"),
        "--checkpoint_dir",
        str(folder / "checkpoints"),
        "--log_dir",
        str(folder / "logs"),
        *flags,
    )


def start(
    ctx: Context,
    name: str,
    data: Path,
    flags: Sequence[str],
    gpus: int = 1,
    device: str | None = None,
    *,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, Path]:
    """Start the launcher for one run in a fresh folder ``work/name``; ``env`` adds to the
    environment."""
    folder = ctx.work / name
    folder.mkdir(parents=True, exist_ok=False)
    command = launcher_command(ctx, folder, data, flags, gpus, device)
    (folder / "command.txt").write_text(" ".join(command) + "\n")
    env = harness.child_env(env)
    with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
        # Its own session: a timeout can stop it without touching this script.
        process = subprocess.Popen(
            command, cwd=folder, env=env, stdout=out, stderr=err, start_new_session=True
        )
    return process, folder


def finish(
    ctx: Context, process: subprocess.Popen, folder: Path, started: float, timeout: float
) -> Run:
    """Wait for a run; past its time, stop it and everything it started."""
    try:
        process.wait(timeout=max(1.0, min(timeout, ctx.seconds_left())))
    except subprocess.TimeoutExpired:
        stop_tree(process)
    return Run(
        folder,
        process.returncode,
        time.monotonic() - started,
        (folder / "stdout.txt").read_text(errors="replace"),
        (folder / "stderr.txt").read_text(errors="replace"),
    )


def launch(
    ctx: Context,
    name: str,
    data: Path,
    flags: Sequence[str],
    gpus: int = 1,
    device: str | None = None,
    timeout: float | None = None,
    *,
    env: dict[str, str] | None = None,
) -> Run:
    started = time.monotonic()
    process, folder = start(ctx, name, data, flags, gpus, device, env=env)
    return finish(ctx, process, folder, started, timeout or RUN_SECONDS)


def stop_tree(process: subprocess.Popen) -> None:
    """SIGTERM to the launcher (it forwards it), then SIGKILL to it and all it started."""
    tree = descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    for pid in [process.pid, *tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def expect_finished(run: Run, epochs: int) -> dict[str, Any]:
    """The run ended with exit 0 and wrote ``epochs`` finite epochs; its figures."""
    if run.returncode != 0:
        raise CheckFailed(f"exit code {run.returncode}: {run.tail()}")
    records = run.history()["epochs"]
    if len(records) != epochs:
        raise CheckFailed(f"history has {len(records)} epochs, expected {epochs}")
    last = records[-1]
    if not all(math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"]) for r in records):
        raise CheckFailed(f"non-finite loss: {[(r['train_loss'], r['val_loss']) for r in records]}")
    return {
        "val_acc": last["val_acc"],
        "img/s": last["train_images_per_sec"],
        "peak MiB": last["peak_memory_mb"],
        "run s": run.seconds,
    }


def load_checkpoint(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


# ----------------------------------------------------------------------------- the checks

TINY = ["--image_size", "32", "--batch_size", "16", "--epochs", "1", "--log_interval", "1"]


def tiny_run(
    name: str,
    flags: Sequence[str],
    expect_in_stdout: str = "",
    checkpoint_test: Callable[[dict], str] | None = None,
    slow: bool = False,
) -> Callable[[Context], dict]:
    """A check: one tiny epoch with ``flags``; optional checks of its output and checkpoint."""

    def check(ctx: Context) -> dict[str, Any]:
        run = launch(
            ctx,
            name,
            dataset(ctx, "tiny"),
            [*TINY, *flags],
            timeout=2 * RUN_SECONDS if slow else None,
        )
        figures = expect_finished(run, 1)
        if expect_in_stdout and expect_in_stdout not in run.stdout:
            raise CheckFailed(f"{expect_in_stdout!r} not in the output", figures)
        if checkpoint_test is not None:
            problem = checkpoint_test(load_checkpoint(run.latest))
            if problem:
                raise CheckFailed(problem, figures)
        return figures

    return check


def scaler_in_use(ckpt: dict) -> str:
    state = ckpt.get("scaler_state_dict")
    if not state or not state.get("scale"):
        return "float16 run saved no GradScaler state"
    return ""


def no_scaler(ckpt: dict) -> str:
    return "bfloat16 run used a GradScaler" if ckpt.get("scaler_state_dict") else ""


def check_world_size_2(ctx: Context) -> dict[str, Any]:
    """NCCL at world size 2, with the host-side (gloo) agreement of --auto_micro_batch and
    --check_sync's comparison of the replicas."""
    run = launch(
        ctx,
        "nccl_ws2",
        dataset(ctx, "tiny"),
        [
            *TINY,
            "--batch_size",
            "8",
            "--use_amp",
            "--auto_micro_batch",
            "--accum_steps",
            "2",
            "--check_sync",
        ],
        gpus=2,
    )
    figures = expect_finished(run, 1)
    if run.history().get("world_size") != 2:
        raise CheckFailed(f"world size {run.history().get('world_size')}, expected 2", figures)
    return figures


# More processes than GPUs share them over gloo (src/imgtrainer/run/preflight.py), and
# tests/fault_injection's start-up hook makes a rank SIGKILL itself at EPOCH:STEP:RANK.
SHARE_GPUS_ENV = {"IMGTRAINER_SHARE_GPUS": "1"}
FAULT_INJECTION = ROOT / "tests" / "fault_injection"
SHARED_GPU_RUN = ["--image_size", "32", "--batch_size", "8", "--log_interval", "1", "--use_amp"]


def kill_env(spec: str) -> dict[str, str]:
    """The environment that makes a run's rank SIGKILL itself at ``spec`` (EPOCH:STEP:RANK),
    on torchrun's first attempt only (tests/fault_injection/sitecustomize.py)."""
    path = [str(FAULT_INJECTION), os.environ.get("PYTHONPATH", "")]
    return {"TRAIN_DDP_KILL_AT": spec, "PYTHONPATH": os.pathsep.join(filter(None, path))}


def expect_world_size(run: Run, world_size: int, figures: dict[str, Any]) -> None:
    found = run.history().get("world_size")
    if found != world_size:
        raise CheckFailed(f"world size {found}, expected {world_size}", figures)


def shared_gpu(cache: str, extra: Sequence[str] = ()) -> Callable[[Context], dict]:
    """2 processes sharing one GPU (gloo) through the real launcher, ``--num_gpus 2``: one tiny
    epoch with AMP and ``--cache_images cache``. Every multi-rank CUDA path runs: DDP's
    all-reduce of CUDA gradients, the metrics' reductions, the shared-out data checks."""

    def check(ctx: Context) -> dict[str, Any]:
        flags = [*SHARED_GPU_RUN, "--epochs", "1", "--cache_images", cache, *extra]
        run = launch(ctx, f"shared_gpu_{cache}", dataset(ctx, "tiny"), flags, 2, env=SHARE_GPUS_ENV)
        figures = expect_finished(run, 1)
        expect_world_size(run, 2, figures)
        return figures

    return check


# 96 images, 8 per process and step on 2 processes: 6 steps per epoch; rank 1 dies after step 5
# of epoch 2, the newest checkpoint is the one of step 4.
SHARED_KILL_AT, SHARED_RESUMED_AT = "2:5:1", "epoch 2, step 4 of 6"


def check_shared_gpu_kill_resume(ctx: Context) -> dict[str, Any]:
    """2 processes sharing one GPU, rank 1 SIGKILLed mid-epoch; torchrun restarts both, they
    resume from the step checkpoint, and the run ends with exit 0 and every epoch once."""
    flags = [*SHARED_GPU_RUN, "--epochs", "2", "--cache_images", "ram", "--save_every_steps", "2"]
    flags += ["--max_restarts", "1", "--resume", "auto"]
    env = {**SHARE_GPUS_ENV, **kill_env(SHARED_KILL_AT)}
    run = launch(ctx, "shared_gpu_kill_resume", dataset(ctx, "tiny"), flags, 2, env=env)
    figures = expect_finished(run, 2)
    expect_world_size(run, 2, figures)
    problem = kill_and_resume_problem(run.folder / "logs", run.history())
    if problem:
        raise CheckFailed(problem, figures)
    return figures


def kill_and_resume_problem(logs: Path, history: dict[str, Any]) -> str:
    """What is wrong with a run that should have been killed at ``SHARED_KILL_AT`` and resumed
    at ``SHARED_RESUMED_AT`` ("" when nothing): the kill, the resume and a history that holds
    each epoch once, in order."""

    def text(name: str) -> str:
        path = logs / name
        return path.read_text(errors="replace") if path.is_file() else ""

    if "killing rank 1 with SIGKILL" not in text("train_rank_1.log"):
        return "rank 1 was not killed: the fault injection did not run"
    if SHARED_RESUMED_AT not in text("train_rank_0.log"):
        return f"no resume at {SHARED_RESUMED_AT} in train_rank_0.log"
    epochs = [record.get("epoch") for record in history.get("epochs", [])]
    if epochs != [1, 2]:
        return f"history holds epochs {epochs}, expected [1, 2]"
    return ""


def resume_across(first: str, second: str) -> Callable[[Context], dict]:
    """One epoch on ``first``, then a second epoch resumed from its checkpoint on ``second``,
    both with --use_amp (fused AdamW and float16 + GradScaler on CUDA, bfloat16 on the CPU)."""

    def check(ctx: Context) -> dict[str, Any]:
        data = dataset(ctx, "tiny")
        flags = [*TINY, "--use_amp"]
        one = launch(ctx, f"resume_{first}_then", data, flags, device=first)
        expect_finished(one, 1)
        two = launch(
            ctx,
            f"resume_then_{second}",
            data,
            [*flags, "--epochs", "2", "--resume", str(one.latest)],
            device=second,
        )
        figures = expect_finished(two, 2)
        return {"epoch 2 loss": two.history()["epochs"][-1]["train_loss"], **figures}

    return check


# 30 steps of 16 images per epoch: a checkpoint after step 5, then the signal, lands mid-epoch.
SIGTERM_RUN = ["--image_size", "112", "--batch_size", "16", "--use_amp", "--cache_images", "ram"]


def check_sigterm_resume(ctx: Context) -> dict[str, Any]:
    """--deterministic: an uninterrupted run, and a run stopped by SIGTERM then resumed, end
    with bitwise equal weights and optimizer state."""
    data = dataset(ctx, "mid")
    flags = [*SIGTERM_RUN, "--epochs", "2", "--deterministic", "--save_every_steps", "5"]
    whole = launch(ctx, "deterministic_whole", data, flags)
    expect_finished(whole, 2)

    started = time.monotonic()
    process, folder = start(ctx, "deterministic_stopped", data, flags)
    written = folder / "checkpoints" / "checkpoint_latest.pth"
    while process.poll() is None and not written.exists() and ctx.seconds_left() > 30:
        time.sleep(0.01)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # what a scheduler's preemption sends
    stopped = finish(ctx, process, folder, started, RUN_SECONDS)
    if stopped.returncode == 0 or not stopped.latest.is_file():
        raise CheckFailed(
            f"SIGTERM: exit code {stopped.returncode}, expected 143 and a "
            f"checkpoint: {stopped.tail()}"
        )
    at = load_checkpoint(stopped.latest)
    position = {
        "exit": stopped.returncode,
        "stopped at epoch": at["epoch"] + 1,
        "step": at.get("step", 0),
    }
    if at["epoch"] >= 2:
        raise CheckFailed("the run finished before SIGTERM arrived", position)

    resumed = launch(ctx, "deterministic_resumed", data, [*flags, "--resume", str(stopped.latest)])
    expect_finished(resumed, 2)
    a, b = load_checkpoint(whole.latest), load_checkpoint(resumed.latest)
    pairs = list(zip_tensors(a["model_state_dict"], b["model_state_dict"]))
    pairs += list(
        zip_tensors(a["optimizer_state_dict"]["state"], b["optimizer_state_dict"]["state"])
    )
    differ = [name for name, x, y in pairs if not bitwise_equal(x, y)]
    figures = {**position, "tensors compared": len(pairs), "differ": len(differ)}
    if differ or not pairs:
        raise CheckFailed(
            f"resumed run differs from the uninterrupted one in {differ[:5]}", figures
        )
    return figures


def zip_tensors(a: Any, b: Any, prefix: str = ""):
    """(name, a's tensor, b's tensor) for every tensor in two nested dicts of the same shape."""
    if isinstance(a, dict):
        for key in a:
            yield from zip_tensors(
                a[key], b.get(key) if isinstance(b, dict) else None, f"{prefix}{key}."
            )
    elif hasattr(a, "shape"):
        yield prefix.rstrip("."), a, b


def bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    return torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def check_low_memory(ctx: Context) -> dict[str, Any]:
    """--low_memory --max_memory_gb 2 at 224 px, batch 64, against the same run without it:
    peak allocated memory (must stay within the budget) and speed (epoch 2 of 2)."""
    data = dataset(ctx, "photos")  # the measurements' one data set, written once
    flags = ["--image_size", "224", "--batch_size", "64", "--epochs", "2", "--cache_images", "ram"]
    normal = launch(ctx, "low_memory_off", data, flags)
    normal_fig = expect_finished(normal, 2)
    low = launch(
        ctx,
        "low_memory_on",
        data,
        [*flags, "--low_memory", "--max_memory_gb", str(LOW_MEMORY_BUDGET_GB)],
    )
    low_fig = expect_finished(low, 2)
    ratio = low_fig["img/s"] / normal_fig["img/s"]
    figures = {
        "peak MiB": low_fig["peak MiB"],
        "normal peak MiB": normal_fig["peak MiB"],
        "img/s": low_fig["img/s"],
        "normal img/s": normal_fig["img/s"],
        "speed ratio": ratio,
        "speed target 0.7": "met" if ratio >= 0.7 else "missed",
        "micro-batch": low.history()["epochs"][-1]["micro_batch"],
    }
    if low_fig["peak MiB"] > LOW_MEMORY_BUDGET_GB * 1024:
        raise CheckFailed(
            f"peak {low_fig['peak MiB']:.0f} MiB is over the {LOW_MEMORY_BUDGET_GB} GiB budget",
            figures,
        )
    return figures


def check_cuda_tests(ctx: Context) -> dict[str, Any]:
    started = time.monotonic()
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(ROOT / "tests"),
        "-q",
        "-k",
        "cuda",
        "-p",
        "no:cacheprovider",
    ]
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=max(1.0, min(RUN_SECONDS, ctx.seconds_left())),
        )
    except subprocess.TimeoutExpired:
        raise CheckFailed("pytest ran out of time") from None
    (ctx.work / "pytest_cuda.txt").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    figures = {"summary": summary.strip("= "), "run s": time.monotonic() - started}
    if done.returncode != 0:
        failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
        raise CheckFailed(
            f"pytest exit {done.returncode}: {failed[:3] or done.stdout[-300:]}", figures
        )
    return figures


def bf16_peak_tflops(gpu_name: str) -> float | None:
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in gpu_name), None)


def throughput_figures(images_per_sec: float, gpu_name: str) -> dict[str, Any]:
    """Achieved training TFLOP/s of ResNet18 at 224 px and its fraction of the bf16 peak."""
    tflops = images_per_sec * 3 * RESNET18_FWD_FLOPS_224 / 1e12
    peak = bf16_peak_tflops(gpu_name)
    return {"TFLOP/s": tflops, "of bf16 peak": tflops / peak if peak else "unknown device peak"}


THROUGHPUT_FLAGS = [
    "--image_size",
    "224",
    "--batch_size",
    "256",
    "--warmup",
    "5",
    "--steps",
    "15",
    "--world_sizes",
    "1",
    "--device",
    "cuda",
]


def throughput(cache: str) -> Callable[[Context], dict]:
    """bench/throughput.py's trainer measurement for one cache mode, against its ceiling (the
    bare loop on tensors in memory, measured once and shared by the cache modes), on the
    mixed-aspect photos; ``source``: where the images came from (what auto chose)."""

    def check(ctx: Context) -> dict[str, Any]:
        bench = load_bench_module("throughput")

        data = dataset(ctx, "photos")
        args = bench.parse_args(
            [
                *THROUGHPUT_FLAGS,
                "--",
                "--use_amp",
                "--amp_dtype",
                "bfloat16",
                "--cache_images",
                cache,
            ]
        )
        folder = ctx.work / f"throughput_{cache}"
        folder.mkdir()
        if "ceiling" not in ctx.shared:
            ctx.shared["ceiling"] = run_bench(bench, args, "ceiling", data, folder)
        trainer = run_bench(bench, args, "trainer", data, folder)
        ceiling = ctx.shared["ceiling"]
        figures = {
            "img/s": trainer["images_per_sec"],
            **throughput_figures(trainer["images_per_sec"], ctx.gpu_name),
            "ceiling img/s": ceiling["images_per_sec"],
            "ceiling of bf16 peak": throughput_figures(ceiling["images_per_sec"], ctx.gpu_name)[
                "of bf16 peak"
            ],
            "efficiency": trainer["images_per_sec"] / ceiling["images_per_sec"],
            "data wait": trainer["step_shares"].get("data_wait", 0.0),
            "loader workers": trainer["loader_workers"],
            "source": trainer["source"],
            "first step s": trainer["seconds_to_first_step"],
        }
        ctx.shared[f"trainer_{cache}"] = trainer
        return figures

    return check


def check_jpeg_decode(ctx: Context) -> dict[str, Any]:
    """JPEG decoding alone, images/s: batched nvJPEG on the GPU against the loader workers the
    trainer would start on the CPU (and one CPU process), on the mixed-aspect photos."""
    bench = load_bench_module("throughput")
    rates = bench.decode_rates(dataset(ctx, "photos") / "train", "cuda")
    figures = {name: r["images_per_sec"] for name, r in rates["rates"].items()}
    if not any(name.startswith("cuda") for name in figures):
        raise CheckFailed("no GPU decoding was measured", figures)
    return figures


# The step variants, most informative first: a run out of time skips the last ones.
STEP_VARIANTS = (
    "eager",
    "adamw_foreach",
    "batch_x2",
    "batch_x4",
    "compile",
    "compile_reduce_overhead",
    "compile_max_autotune_no_cudagraphs",
)


def check_step_variants(ctx: Context) -> dict[str, Any]:
    """The bare step (ResNet18, 224 px, bf16, channels_last, batch 256) eager and with each of
    bench/throughput.py's STEP_VARIANTS: images/s relative to eager, and the first step's
    seconds (compilation included). Long (compiling takes minutes): run it on its own,
    ``--only step_variants``."""
    bench = load_bench_module("throughput")
    data = dataset(ctx, "photos")  # the ceiling reads no images; the data set already written
    args = bench.parse_args([*THROUGHPUT_FLAGS, "--", "--use_amp", "--amp_dtype", "bfloat16"])
    folder = ctx.work / "step_variants"
    folder.mkdir()
    figures: dict[str, Any] = {}
    eager = None
    for variant in STEP_VARIANTS:
        if ctx.seconds_left() < 150:
            figures[variant] = "skipped: out of time"
            continue
        run_args = argparse.Namespace(**{**vars(args), "variant": variant})
        result = run_bench(bench, run_args, "ceiling", data, folder)
        eager = eager or result["images_per_sec"]
        figures[f"{variant} img/s"] = result["images_per_sec"]
        figures[f"{variant} vs eager"] = result["images_per_sec"] / eager
        figures[f"{variant} first step s"] = result["first_step_seconds"]
        ctx.shared[f"step_{variant}"] = result
    return figures


def load_bench_module(name: str) -> Any:
    """A sibling script loaded from its file, not through sys.path: with bench/ on the path,
    bench/memory.py would shadow src/memory.py for the trainer's own imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_bench(
    bench: Any, args: argparse.Namespace, mode: str, data: Path, folder: Path
) -> dict[str, Any]:
    name = f"{mode}_{args.variant}" if getattr(args, "variant", None) else mode
    try:
        return bench.run_worker(args, mode, 1, data, folder / f"{name}.json")
    except SystemExit as err:  # run_worker exits with the worker's stderr on failure
        raise CheckFailed(f"bench/throughput.py {mode}: {str(err.code)[-600:]}") from None


def all_checks() -> list[Check]:
    return [
        Check(
            "cuda_ws1_fp16_gradscaler",
            tiny_run("ws1_fp16", ["--use_amp"], checkpoint_test=scaler_in_use),
        ),
        Check(
            "bf16",
            tiny_run("bf16", ["--use_amp", "--amp_dtype", "bfloat16"], checkpoint_test=no_scaler),
        ),
        Check(
            "channels_last_off", tiny_run("channels_last_off", ["--use_amp", "--no_channels_last"])
        ),
        Check(
            "cache_gpu",
            tiny_run(
                "cache_gpu",
                ["--use_amp", "--cache_images", "gpu"],
                expect_in_stdout="decoded images in gpu",
            ),
        ),
        Check(
            "cache_ram",
            tiny_run(
                "cache_ram",
                ["--use_amp", "--cache_images", "ram"],
                expect_in_stdout="filled as the images are first read",
            ),
        ),
        Check("cache_none", tiny_run("cache_none", ["--use_amp", "--cache_images", "none"])),
        Check("compile", tiny_run("compile", ["--use_amp", "--compile"], slow=True)),
        Check("nccl_ws2", check_world_size_2, gpus=2),
        Check(
            "shared_gpu_ws2_cache_gpu",
            shared_gpu(
                "gpu", ["--amp_dtype", "bfloat16", "--auto_micro_batch", "--accum_steps", "2"]
            ),
        ),
        Check("shared_gpu_ws2_cache_ram", shared_gpu("ram", ["--check_sync"])),
        Check("shared_gpu_ws2_cache_none", shared_gpu("none")),
        Check("shared_gpu_ws2_kill_resume", check_shared_gpu_kill_resume),
        Check("resume_cpu_to_gpu", resume_across("cpu", "cuda")),
        Check("resume_gpu_to_cpu", resume_across("cuda", "cpu")),
        Check("sigterm_resume_deterministic", check_sigterm_resume),
        Check("pytest_cuda", check_cuda_tests),
        Check("low_memory_224", check_low_memory, measurement=True),
        *[
            Check(f"throughput_224_cache_{cache}", throughput(cache), measurement=True)
            for cache in ("gpu", "ram", "none", "auto")
        ],
        Check("jpeg_decode", check_jpeg_decode, measurement=True),
        Check("step_variants", check_step_variants, measurement=True, default=False),
        *sync_checks(),
    ]


# ----------------------------------------------------------------------------- syncs, decode race

SYNC_SOURCES = ("gpu", "ram", "none")


def sync_audit_commands(ctx: Context, source: str) -> list[tuple[str, list[str], Path]]:
    """bench/sync_audit.py's runs for one --cache_images source: float16 + EMA (with a
    torch.profiler trace of its 10 steps in the output folder) and bfloat16 + EMA; each
    (precision, command, its JSON summary)."""
    traces = (ctx.outputs or ctx.work) / "gpu_check_traces"
    runs = []
    for precision in ("fp16", "bf16"):
        summary = ctx.work / f"sync_audit_{source}_{precision}.json"
        command = [sys.executable, str(ROOT / "bench" / "sync_audit.py"), "--source", source]
        command += ["--precision", precision, "--output", str(summary)]
        if precision == "fp16":
            command += ["--trace", str(traces / f"steps_{source}_{precision}.json")]
        runs.append((precision, command, summary))
    return runs


def sync_audit(source: str) -> Callable[[Context], dict]:
    """No host-device synchronisation between logging steps over 10 steps of --cache_images
    ``source``, by the dispatch-mode audit and torch.cuda.set_sync_debug_mode("warn")."""

    def check(ctx: Context) -> dict[str, Any]:
        figures: dict[str, Any] = {}
        problems = []
        for precision, command, summary in sync_audit_commands(ctx, source):
            try:
                done = subprocess.run(
                    command, cwd=ROOT, capture_output=True, text=True,
                    timeout=max(1.0, min(RUN_SECONDS, ctx.seconds_left())),
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                raise CheckFailed(f"{precision}: sync audit ran out of time", figures) from None
            (ctx.work / f"sync_audit_{source}_{precision}.txt").write_text(
                done.stdout + done.stderr
            )
            if not summary.exists():
                raise CheckFailed(f"{precision}: exit {done.returncode}: {done.stderr[-300:]}")
            result = json.loads(summary.read_text())
            figures[f"{precision} ops/step"] = max(result["ops_per_plain_step"], default=0)
            figures[f"{precision} syncs"] = sum(result["syncs_per_window"].values())
            bad = result["unexpected_syncs"] + result["unexpected_cuda_warnings"]
            if bad or done.returncode != 0:
                problems.append(f"{precision}: {bad[:3] or done.stderr[-200:]}")
        if problems:
            raise CheckFailed("; ".join(problems), figures)
        return figures

    return check


def decode_race_command() -> list[str]:
    """The nvjpeg decode-race test (review C4): decoding while the previous step's work is
    queued and its blocks freed."""
    test = str(ROOT / "tests" / "test_jpeg_device.py")
    return [sys.executable, "-m", "pytest", "-m", "cuda", test, "-q", "-p", "no:cacheprovider"]


def check_decode_race(ctx: Context) -> dict[str, Any]:
    try:
        done = subprocess.run(
            decode_race_command(), cwd=ROOT, capture_output=True, text=True,
            timeout=max(1.0, min(RUN_SECONDS, ctx.seconds_left())),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise CheckFailed("pytest ran out of time") from None
    (ctx.work / "decode_race.txt").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or [""])[-1].strip("= ")
    if done.returncode != 0:
        raise CheckFailed(f"pytest exit {done.returncode}: {summary}", {"summary": summary})
    return {"summary": summary}


def sync_checks() -> list[Check]:
    return [
        *[Check(f"sync_audit_cache_{source}", sync_audit(source)) for source in SYNC_SOURCES],
        Check("decode_race", check_decode_race),
    ]


# ----------------------------------------------------------------------------- main


def visible_gpus() -> tuple[int, str]:
    import torch

    if not torch.cuda.is_available():
        return 0, ""
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def print_result(r: Result) -> None:
    """One line as each check ends (and its first detail line if it did not pass), so a run
    cut short still shows what it found."""
    print(f"  {r.status:<5} {r.name} ({r.seconds:.0f}s) {format_figures(r.figures)}", flush=True)
    if r.status != "pass" and r.detail:
        print(f"        -> {r.detail.splitlines()[0][:300]}", flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=ROOT / "bench_results" / "gpu_check.json")
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--jobs", type=int, default=4, help="functional checks run at once")
    parser.add_argument(
        "--work_dir",
        type=Path,
        default=None,
        help="keep every run here (default: a temporary folder, removed)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=TOTAL_SECONDS,
        help="time budget; checks not started by then are skipped",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    gpus, name = visible_gpus()
    if gpus == 0:
        print("gpu_check: no CUDA device visible; nothing was checked")
        return 0
    checks = all_checks()
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in checks}
        if unknown:
            print(
                f"error: unknown check(s) {sorted(unknown)}; choose from "
                f"{[c.name for c in checks]}",
                file=sys.stderr,
            )
            return 2
        checks = [c for c in checks if c.name in wanted]
    else:
        checks = [c for c in checks if c.default]
    print(f"gpu_check: {len(checks)} checks on {gpus} x {name}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(work, gpus, name, deadline=started + args.seconds, outputs=args.output.parent)
        results = run_checks(
            checks,
            ctx,
            args.jobs,
            on_result=print_result,
        )
    seconds = time.monotonic() - started
    print("\n" + format_table(results) + f"\ntotal {seconds:.0f}s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(build_report(results, ctx, seconds), indent=2, default=str) + "\n"
    )
    print(f"Wrote {args.output}")
    return 0 if all(r.status in ("pass", "skip") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Launcher runs in folders of their own, as the CUDA checks (tests/gpu/) and bench/gpu_check.py
start them: ``python launch_ddp.py --device cuda --num_gpus N`` (``--nproc N`` on the CPU) on a
generated data set, with the run's checkpoints, logs, command and output in its folder; past its
time it is stopped with everything it started; what it wrote is read back."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.harness import child_env, descendants, launcher_command

RUN_SECONDS = 240.0  # one launcher run, at most (--compile: twice that)


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

    def log(self, name: str) -> str:
        """A log file of the run (``train_rank_0.log``), "" if it wrote none."""
        path = self.folder / "logs" / name
        return path.read_text(errors="replace") if path.is_file() else ""

    def tail(self, chars: int = 600) -> str:
        text = (self.stderr.strip() or self.stdout.strip())[-chars:]
        return text.replace("\n", " | ")


def run_command(
    folder: Path, data: Path, flags: Sequence[str], gpus: int = 1, device: str = "cuda"
) -> list[str]:
    """The launcher on ``data``'s train/ and val/, writing into ``folder``, then ``flags``."""
    placement = ["--num_gpus", str(gpus)] if device == "cuda" else ["--nproc", str(gpus)]
    return launcher_command(
        "--device", device, *placement,
        "--train_dir", str(data / "train"), "--val_dir", str(data / "val"),
        "--checkpoint_dir", str(folder / "checkpoints"), "--log_dir", str(folder / "logs"),
        *flags,
    )  # fmt: skip


def start(
    folder: Path,
    data: Path,
    flags: Sequence[str],
    gpus: int = 1,
    device: str = "cuda",
    *,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """The launcher started for one run in ``folder`` (new: a run never reuses another's);
    ``env`` adds to the environment."""
    folder.mkdir(parents=True, exist_ok=False)
    command = run_command(folder, data, flags, gpus, device)
    (folder / "command.txt").write_text(" ".join(command) + "\n")
    with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
        # Its own session: a timeout can stop it without touching this process.
        return subprocess.Popen(
            command, cwd=folder, env=child_env(env), stdout=out, stderr=err, start_new_session=True
        )


def finish(process: subprocess.Popen, folder: Path, started: float, timeout: float) -> Run:
    """Wait for a run; past ``timeout`` seconds, stop it and everything it started."""
    try:
        process.wait(timeout=timeout)
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
    folder: Path,
    data: Path,
    flags: Sequence[str],
    gpus: int = 1,
    device: str = "cuda",
    *,
    timeout: float = RUN_SECONDS,
    env: dict[str, str] | None = None,
) -> Run:
    """One run in ``folder`` to its end (``start``, ``finish``)."""
    started = time.monotonic()
    process = start(folder, data, flags, gpus, device, env=env)
    return finish(process, folder, started, timeout)


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
    """The run ended with exit 0 and wrote ``epochs`` epochs of finite losses (AssertionError
    otherwise, with what went wrong); its last epoch's figures."""
    if run.returncode != 0:
        raise AssertionError(f"exit code {run.returncode}: {run.tail()}")
    records = run.history()["epochs"]
    if len(records) != epochs:
        raise AssertionError(f"history has {len(records)} epochs, expected {epochs}")
    if not all(math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"]) for r in records):
        losses = [(r["train_loss"], r["val_loss"]) for r in records]
        raise AssertionError(f"non-finite loss: {losses}")
    last = records[-1]
    return {
        "val_acc": last["val_acc"],
        "img/s": last["train_images_per_sec"],
        "peak MiB": last["peak_memory_mb"],
        "run s": run.seconds,
    }


def load_checkpoint(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, list[str]]:
    """How many tensors of two checkpoints' weights and optimizer state were compared, and the
    names of those not bitwise equal (or missing from ``b``)."""
    pairs = list(zip_tensors(a["model_state_dict"], b["model_state_dict"]))
    pairs += zip_tensors(a["optimizer_state_dict"]["state"], b["optimizer_state_dict"]["state"])
    return len(pairs), [name for name, x, y in pairs if not bitwise_equal(x, y)]


def zip_tensors(a: Any, b: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
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


def kill_and_resume_problem(run: Run, killed_rank: int, resumed_at: str, epochs: int) -> str:
    """What is wrong with a run whose rank ``killed_rank`` the fault injection (``conftest.kill_at``)
    should have SIGKILLed, resumed at ``resumed_at`` ("epoch 2, step 4 of 6"), "" when nothing:
    the kill, the resume, and a history that holds each of ``epochs`` epochs once, in order."""
    if f"killing rank {killed_rank} with SIGKILL" not in run.log(f"train_rank_{killed_rank}.log"):
        return f"rank {killed_rank} was not killed: the fault injection did not run"
    if resumed_at not in run.log("train_rank_0.log"):
        return f"no resume at {resumed_at} in train_rank_0.log"
    found = [record.get("epoch") for record in run.history().get("epochs", [])]
    if found != list(range(1, epochs + 1)):
        return f"history holds epochs {found}, expected {list(range(1, epochs + 1))}"
    return ""

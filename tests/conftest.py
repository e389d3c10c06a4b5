"""Shared helpers: tiny generated image folders, running the real tools (in this process or as
a user would, in a new interpreter: ``support/harness.py``, shared with the benchmarks), and one
trained run shared by the tests that need one."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(ROOT))  # dev/: the repository's own tools (doc generators, the floors)

import torch  # noqa: E402

from imgtrainer.config import TrainConfig  # noqa: E402
from imgtrainer.data.layouts.files import folder_table  # noqa: E402
from imgtrainer.data.layouts.table import TableImages  # noqa: E402
from imgtrainer.distributed.setup import DistInfo  # noqa: E402
from imgtrainer.precision import Precision  # noqa: E402
from imgtrainer.training.memory import MemoryPlan  # noqa: E402
from imgtrainer.training.step import RunParts  # noqa: E402
from support.harness import run_cli, run_launcher, start_launcher, write_image_folder  # noqa: E402, F401

FP32 = Precision(False, torch.float32)  # no autocast, no loss scaling
CPU = torch.device("cpu")
ONE_CPU_PROCESS = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU)


def data_config(train: Path, val: Path, **values) -> TrainConfig:
    """A config for ``build_datasets`` on tiny folders: no image cache, logs beside the data."""
    defaults = {"cache_images": "none", "log_dir": str(Path(train).parent / "logs")}
    return TrainConfig(train_dir=str(train), val_dir=str(val), **{**defaults, **values})


def folder_images(root: Path, class_names: Sequence[str] | None = None) -> TableImages:
    """The images of a class folder as the trainer reads them (``class_names`` fixes the labels,
    as a checkpoint's classes do)."""
    names = list(class_names) if class_names is not None else None
    return TableImages(folder_table(Path(root), "training", names))


def entries_of(folder: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    """(image path, label) of a class folder in the trainer's order, and its classes."""
    table = folder_images(folder).table
    return [(Path(table.location(i)), table.label(i)) for i in range(len(table))], table.classes


def pack_folder(folder: Path, out: Path, fmt: str, shard_size: int = 7) -> str:
    """``folder``'s images as Parquet files or tar shards (``fmt``) in ``out``, as prepare_data
    writes them (several files, a short last one); returns the --train_data value."""
    from imgtrainer.tools.pack_data import write_parquet, write_shards

    entries, classes = entries_of(folder)
    write = write_parquet if fmt == "parquet" else write_shards
    spec = write(entries, classes, out, shard_size, 1)
    return str(out / spec) if spec else str(out)


def cpu_run_parts(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: MemoryPlan,
    criterion: torch.nn.Module | None = None,
) -> RunParts:
    """The parts a step works with (``RunParts``) as the trainer builds them on the CPU in float32, with a
    constant learning rate and cross-entropy unless ``criterion`` says otherwise."""
    return RunParts(
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        torch.amp.GradScaler("cpu", enabled=False),
        criterion or torch.nn.CrossEntropyLoss(),
        FP32,
        plan,
        CPU,
    )


CLASSES = ["cat", "dog", "fox"]


def write_tiny_dataset(root: Path) -> tuple[Path, Path]:
    """3 classes, 16 train and 5 val images each (15 val: not a multiple of 2)."""
    return (
        write_image_folder(root / "data" / "train", CLASSES, 16, seed=1),
        write_image_folder(root / "data" / "val", CLASSES, 5, seed=2),
    )


@pytest.fixture
def tiny_dataset(tmp_path: Path) -> tuple[Path, Path]:
    return write_tiny_dataset(tmp_path)


# Flags that make a training run on the tiny dataset take seconds: timm's test_resnet (0.3 M
# parameters, checkpoints of 2 MB instead of 130 MB) for everything the model does not change;
# RESNET18 where a test reads the product's own model (plain loads, its exports, its memory).
RESNET18 = ["--model", "resnet18"]
TINY_FLAGS = [
    "--model",
    "test_resnet",
    "--image_size",
    "16",
    "--batch_size",
    "8",
    "--num_workers",
    "0",
    "--learning_rate",
    "0.01",
    "--log_interval",
    "1",
]


def tiny_run_flags(train: Path, val: Path) -> list[str]:
    """``--train_dir TRAIN --val_dir VAL`` and ``TINY_FLAGS``: a training run of seconds."""
    return ["--train_dir", str(train), "--val_dir", str(val), *TINY_FLAGS]


# ----------------------------------------------------------------------------- new interpreters


def fault_env(**variables: str) -> dict[str, str]:
    """``variables`` of tests/fault_injection/sitecustomize.py, and that folder on PYTHONPATH:
    every process of the run loads it and adds the hooks they name."""
    path = [str(Path(__file__).parent / "fault_injection"), os.environ.get("PYTHONPATH", "")]
    return {**variables, "PYTHONPATH": os.pathsep.join(filter(None, path))}


def kill_at(spec: str) -> dict[str, str]:
    """The environment that makes a run SIGKILL itself at EPOCH:STEP[:RANK] (first torchrun
    attempt only)."""
    return fault_env(TRAIN_DDP_KILL_AT=spec)


def held_until_stopped(processes: int = 2) -> dict[str, str]:
    """The environment that makes every rank of a run on ``processes`` wait after each step
    (after its checkpoint) until a stop signal comes: a signal sent once a checkpoint exists
    lands in the same epoch, however fast the machine."""
    return fault_env(TRAIN_DDP_STEP_DELAY=f"300:{processes}")


def launch_on_cpu(
    train: Path, val: Path, *flags: object, cwd: Path, nproc: int = 2, **kwargs
) -> subprocess.CompletedProcess:
    """``python launch_ddp.py --device cpu --nproc NPROC`` on ``train`` and ``val`` with
    ``TINY_FLAGS``, then ``flags`` (a flag given again wins), to its end; ``kwargs``:
    ``run_launcher``'s ``timeout`` and ``env``."""
    args = ["--device", "cpu", "--nproc", nproc, *tiny_run_flags(train, val), *flags]
    return run_launcher(args, cwd, **kwargs)


def assert_user_error(result: subprocess.CompletedProcess, *phrases: str) -> None:
    """Exit code 2, one error line naming the problem, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in error_lines[0], error_lines[0]


# ----------------------------------------------------------------------------- in this process


@contextlib.contextmanager
def restored_process_state() -> Iterator[None]:
    """What a tool's ``main`` changes in its process and a test must not leak to the next one:
    the deterministic-algorithms switch (``--deterministic``). (The logging set-up undoes
    itself: ``distributed.logging_for_run``.)"""
    torch = sys.modules.get("torch")  # not imported here: the plotting tests run without it
    deterministic = torch is not None and torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch = sys.modules.get("torch")
        # Only when it changed: setting it imports torch._inductor (seconds).
        if torch is not None and torch.are_deterministic_algorithms_enabled() != deterministic:
            torch.use_deterministic_algorithms(deterministic)


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    with restored_process_state():
        yield


def share_of_the_cores() -> set[int]:
    """This test process's share of the cores under pytest-xdist (pytest.ini), all of them
    without it."""
    cores = os.sched_getaffinity(0)
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        return cores
    ordered, count = sorted(cores), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    index = int(worker.removeprefix("gw"))
    return set(ordered[index::count]) or {ordered[index % len(ordered)]}


# Each test process, and every process it starts, works on its share of the cores, as runs
# started side by side with taskset would: the trainer and the tools take as many threads and
# loader workers as their process has cores (``cpu_cores_available``). Two test processes that
# each took both cores ran twice as many torch threads as there are cores (the quick suite 1.4x
# slower). Set before any fixture, so that a run in a fixture and the run a test compares it
# with use the same threads (their float sums then agree to the bit). A test marked
# ``all_cores`` times the processes it starts against each other (a hang named within a
# margin): they run on all the cores, as a user's would.
ALL_CORES, SHARE = os.sched_getaffinity(0), share_of_the_cores()
os.sched_setaffinity(0, SHARE)
torch.set_num_threads(len(SHARE))


@pytest.fixture(autouse=True)
def _all_cores_for_the_processes_it_times(request) -> Iterator[None]:
    if request.node.get_closest_marker("all_cores") is None or SHARE == ALL_CORES:
        yield
        return
    os.sched_setaffinity(0, ALL_CORES)
    try:
        yield
    finally:
        os.sched_setaffinity(0, SHARE)
        torch.set_num_threads(len(SHARE))


def pytest_unconfigure(config) -> None:
    """The test process is done: what it imported (torch, timm, moto, ...) is frozen out of the
    garbage collector, whose passes at the interpreter's teardown took 3 s of every run."""
    gc.freeze()


def run_main(main: Callable[[list[str]], int], argv: Sequence, cwd: Path | None = None) -> int:
    """A tool's ``main`` in this process, as its command line would run it (in ``cwd``): its
    return value, or the code it exits with (2 for a user error)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(restored_process_state())
        if cwd is not None:
            stack.enter_context(pytest.MonkeyPatch.context()).chdir(cwd)
        try:
            return main([str(a) for a in argv])
        except SystemExit as exit_:
            return exit_.code


def user_error_line(
    main: Callable[[list[str]], int], argv: Sequence, capsys, cwd: Path | None = None
) -> str:
    """Runs ``main`` in this process; asserts it exits with code 2 and one error line on stderr,
    without a traceback, and returns that line."""
    capsys.readouterr()
    code = run_main(main, argv, cwd)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1, (code, out, err)
    assert "Traceback" not in out + err
    return lines[0]


def run_train(argv: Sequence, cwd: Path) -> int:
    """``python src/train_ddp.py ARGV`` in this process (world size 1), in ``cwd``."""
    import imgtrainer.run.train as train_ddp

    return run_main(train_ddp.main, ["--device", "cpu", *argv], cwd)


# ----------------------------------------------------------------------------- a shared run


@dataclass(frozen=True)
class TrainedRun:
    """A finished 2-epoch, single-process run on the tiny dataset. Shared by every test of the
    session: read it, or ``copy_to`` a folder of your own before resuming or changing it."""

    root: Path
    train: Path
    val: Path

    @property
    def best(self) -> Path:
        return self.root / "checkpoints" / "checkpoint_best.pth"

    @property
    def flags(self) -> list[str]:
        return [*tiny_run_flags(self.train, self.val), *RESNET18]  # loaded as plain ResNet18s

    def copy_to(self, workdir: Path) -> Path:
        """The run's checkpoints and logs in ``workdir``, as if it had run there."""
        for name in ("checkpoints", "logs"):
            shutil.copytree(self.root / name, workdir / name)
        return workdir


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> TrainedRun:
    """Trained once per session: under pytest-xdist the first test process to need it trains it
    in the session's folder, and the other waits for it and reads it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "trained_run"
    with FileLock(str(shared / "trained_run.lock")):
        if (root / "trained").exists():
            return TrainedRun(root, root / "data" / "train", root / "data" / "val")
        shutil.rmtree(root, ignore_errors=True)  # what a failed try left
        run = TrainedRun(root, *write_tiny_dataset(root))
        assert run_train([*run.flags, "--epochs", "2"], cwd=root) == 0
        (root / "trained").touch()
    return run

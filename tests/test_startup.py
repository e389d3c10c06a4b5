"""A quick start: the launcher without torch, GPUs counted without torch, workers forked from an
agent that imported the trainer once, the decode check remembered, the shared rule for class
folders, and how the launcher reads the ranks' endings."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import ANY

import pytest

import imgtrainer.data.layouts.decode_check as decode_check
import imgtrainer.process as process
import imgtrainer.run.launcher as launch_ddp
import imgtrainer.run.lifecycle as lifecycle
import imgtrainer.run.preflight as preflight
import imgtrainer.run.quick_exit as quick_exit
from conftest import ROOT, SRC, TINY_FLAGS, folder_images, run_cli, write_image_folder
from imgtrainer.data.layouts.folder_checks import find_classes
from imgtrainer.data.layouts.image_files import class_folders
from imgtrainer.data.layouts.shards import TAR
from imgtrainer.data.layouts.table import READABLE, UNKNOWN, UNREADABLE, ImageTable
from imgtrainer.errors import UserError
from imgtrainer.process import STOP_SIGNALS
from imgtrainer.run import outcome as run_outcome

# ----------------------------------------------------------------------------- torch-free launcher


def modules_after(*args: str, cwd: Path) -> tuple[int, set[str]]:
    """The launcher's exit code and the heavy modules it imported, run in a fresh interpreter."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['launch_ddp.py', *{list(args)!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'launch_ddp.py')!r}, run_name='__main__')\n"
        "except SystemExit as end:\n"
        "    code = end.code\n"
        "heavy = [m for m in ('torch', 'torchvision', 'timm') if m in sys.modules]\n"
        "print('MODULES', code, *heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    line = next(row for row in result.stdout.splitlines() if row.startswith("MODULES"))
    _, exit_code, *heavy = line.split()
    return int(exit_code), set(heavy)


def test_launcher_help_and_checks_import_no_torch(tmp_path: Path):
    assert modules_after("--help", cwd=tmp_path) == (0, set())
    # A bad input found by the launcher's own checks: exit 2 before anything heavy is imported.
    assert modules_after("--device", "cpu", cwd=tmp_path) == (2, set())
    train = write_image_folder(tmp_path / "train", ["a", "b"], 2)
    val = write_image_folder(tmp_path / "val", ["a", "b"], 2)
    (train / "c").mkdir()
    (val / "c").mkdir()
    assert modules_after(
        "--device", "cpu", "--train_dir", str(train), "--val_dir", str(val), cwd=tmp_path
    ) == (2, set())


def test_launcher_checks_empty_class_folder_and_file_as_folder(tmp_path: Path):
    from imgtrainer.config import parse_config

    train = write_image_folder(tmp_path / "train", ["a", "b"], 4)
    val = write_image_folder(tmp_path / "val", ["a", "b"], 2)
    flags = [
        "--device",
        "cpu",
        "--train_dir",
        str(train),
        "--val_dir",
        str(val),
        "--batch_size",
        "2",
    ]
    preflight.launcher_checks(parse_config(flags), "cpu", 2)  # fine as it is
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(UserError, match="--checkpoint_dir .* is a file"):
        preflight.launcher_checks(
            parse_config([*flags, "--checkpoint_dir", str(tmp_path / "taken")]), "cpu", 2
        )
    (val / "c").mkdir()
    (train / "c").mkdir()
    (train / "c" / "notes.txt").write_text("not an image")
    with pytest.raises(UserError, match="class folder.s. c hold no image files"):
        preflight.launcher_checks(parse_config(flags), "cpu", 2)


def test_a_cpu_run_hides_the_gpus_from_its_workers(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    args = launch_ddp.build_parser().parse_args([])
    assert launch_ddp.torchrun_env(args, "cpu", 2)["CUDA_VISIBLE_DEVICES"] == ""
    assert launch_ddp.torchrun_env(args, "cuda", 2)["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize(
    "listed, installed, expected",
    [
        (None, ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"], 2),
        ("1", ["nvidia0", "nvidia1"], 1),
        ("0,1,2,3", ["nvidia0", "nvidia1"], 2),
        ("", ["nvidia0"], 0),
        ("-1", ["nvidia0"], 0),
        ("0,-1,1", ["nvidia0", "nvidia1"], 1),  # CUDA stops at the first invalid entry
        ("GPU-8f6e", ["nvidia0"], 1),
        (None, ["null", "tty"], 0),
    ],
)
def test_visible_gpu_count_without_torch(monkeypatch, listed, installed, expected):
    monkeypatch.setattr(process, "_dev_entries", lambda: installed)
    if listed is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert process.visible_gpu_count() == expected


# ----------------------------------------------------------------------------- forked workers


def test_quick_exit_calls_an_entry_point_like_its_console_script(tmp_path: Path, monkeypatch):
    (tmp_path / "entry_points.py").write_text(
        "import sys\n"
        "def returns():\n    return len(sys.argv)\n"
        "def exits():\n    sys.exit(3)\n"
        "def done():\n    pass\n"
        "def fails():\n    raise ValueError('a bug')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert quick_exit.run_entry_point(["entry_points:returns", "a", "b"]) == 3  # [module, a, b]
    assert sys.argv == ["entry_points", "a", "b"]
    assert quick_exit.run_entry_point(["entry_points:exits"]) == 3
    assert quick_exit.run_entry_point(["entry_points:done"]) == 0
    assert quick_exit.run_entry_point(["entry_points:fails"]) == 1
    assert quick_exit.run_entry_point(["-m", "entry_points"]) == 2  # usage
    assert quick_exit.run_entry_point(["--preload", "entry_points", "entry_points:done"]) == 0
    assert "entry_points" in sys.modules


def forked_rank_exit_code(code: int) -> int | None:
    """The exit code of a rank forked by multiprocessing (as torch elastic forks them) that has a
    loader worker ignoring SIGTERM and calls ``lifecycle.exit_now(code)``; None if it hung."""
    script = (
        "import multiprocessing, signal, sys, time\n"
        f"sys.path.insert(0, {str(SRC)!r})\n"
        "from imgtrainer.process import die_with_parent\n"
        "from imgtrainer.run.lifecycle import exit_now\n"
        "def loader_worker():  # as data.quiet_loader_worker makes them\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    die_with_parent(signal.SIGKILL)\n"
        "    time.sleep(300)\n"
        "def rank():\n"
        "    fork = multiprocessing.get_context('fork')\n"
        "    fork.Process(target=loader_worker, daemon=True).start()\n"
        f"    exit_now({code})\n"
        "if __name__ == '__main__':\n"
        "    process = multiprocessing.get_context('fork').Process(target=rank)\n"
        "    process.start()\n"
        "    process.join(30)\n"
        "    print('EXIT', process.exitcode)\n"
        "    if process.exitcode is None:\n"
        "        process.kill()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    line = next(row for row in result.stdout.splitlines() if row.startswith("EXIT"))
    return None if line.split()[1] == "None" else int(line.split()[1])


def test_a_forked_rank_exits_through_multiprocessing_and_takes_its_loader_workers():
    """Done (0): back to multiprocessing, which hands torch elastic the return value; its loader
    workers, which ignore multiprocessing's SIGTERM, are killed instead of waited for forever.
    Any other code: the process's own exit code."""
    assert forked_rank_exit_code(0) == 0
    assert forked_rank_exit_code(2) == 2


@pytest.mark.slow
def test_launcher_runs_with_spawned_workers_too(tiny_dataset, tmp_path: Path):
    """--start_method spawn (the CUDA default): torchrun's own way, fresh worker processes. Its
    timeline (bench/startup.py's instrument, which wraps functions of every process's modules,
    the agent's too, set up here as bench/startup.py sets it up: a sitecustomize on PYTHONPATH)
    holds every phase of the start and end, in order."""
    train, val = tiny_dataset
    args = ["--device", "cpu", "--start_method", "spawn", "--epochs", "1", *TINY_FLAGS]
    timeline = tmp_path / "timeline.txt"
    python_path = [str(ROOT / "bench" / "instrument"), os.environ.get("PYTHONPATH", "")]
    result = run_cli(
        [ROOT / "launch_ddp.py", *args, "--train_dir", train, "--val_dir", val],
        cwd=tmp_path,
        env={
            "TRAIN_DDP_TIMELINE": str(timeline),
            "PYTHONPATH": os.pathsep.join(filter(None, python_path)),
        },
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert "--run-path" not in result.stdout.splitlines()[0]
    assert "Done: best val_acc" in result.stdout
    lines = [line.split(" ", 2) for line in timeline.read_text().splitlines()]
    by_process = {}
    for stamp, who, event in lines:
        by_process.setdefault(who, []).append((float(stamp), event))
    launcher = ["launcher start", "torchrun start", "torchrun exited"]
    rank = ["worker start", "imports done", "process group ready"]
    rank += ["images cached"] * any(e == "images cached" for _, e in by_process["rank0"])
    rank += [
        "data check started",
        "model ready",
        "first step done",
        "summary logged",
        "process group destroyed",
    ]
    assert [e for _, e in by_process["launcher"]] == launcher
    assert [e for _, e in by_process["rank0"]] == [*rank, "worker exit"]
    order = sorted(by_process["launcher"] + by_process["rank0"], key=lambda pair: pair[0])
    assert [e for _, e in order] == [*launcher[:2], *rank, "worker exit", launcher[2]], order


def _killed_on(task: int, index: int) -> int:
    if index == task:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
    return index * index


def test_forked_map_gives_every_result_and_raises_a_childs_error():
    assert process.process_map(abs, [-3, 1, -2, 5, -1], 2, chunksize=2) == [3, 1, 2, 5, 1]
    forked = process.ForkedMap(lambda x: 1 // x, [1, 0], 2)
    with pytest.raises(ZeroDivisionError) as raised:
        dict(forked.results())
    forked.close()
    assert forked.children == {}
    assert "1 // x" in str(raised.value.__cause__)  # the child's traceback


@pytest.mark.parametrize("killed", ["before its first task", "in its task"])
def test_forked_map_does_the_task_of_a_lost_child_itself(killed):
    """A child ends at any moment without leaving anything waiting on it: there is no lock
    between the processes for it to die holding (``Pool.terminate`` deadlocked on one, and
    hung CI for good)."""
    parent = os.getpid()
    tasks = list(range(6))

    def start(number: int) -> None:
        if killed == "before its first task" and number == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def square(index: int) -> int:
        return _killed_on(3 if os.getpid() != parent and killed == "in its task" else -1, index)

    forked = process.ForkedMap(square, tasks, 2, start=start)
    try:
        done = dict(forked.results())
    finally:
        forked.close()
    assert done == {i: i * i for i in tasks}
    assert [code for _, code in forked.lost] == [-signal.SIGKILL]


def test_forked_map_closed_from_another_thread_stops_its_results():
    """As a run ends: the training thread closes the decode check while the check's own thread
    reads its results and closes it too; every child killed, each pipe closed once."""
    import threading
    import time

    for delay in (0.0, 0.01, 0.03, 0.05, 0.1, 0.3) * 2:  # the old close() failed 15 in 72
        forked = process.ForkedMap(time.sleep, [60, 60], 2)
        children = list(forked.children.values())
        read: list = []

        def collect(forked=forked, read=read) -> None:
            try:
                read.extend(forked.results())
                forked.close()
            except Exception as err:  # an fd closed twice, a child popped twice
                read.append(err)

        reader = threading.Thread(target=collect)
        reader.start()
        time.sleep(delay)
        forked.close()
        reader.join(30)
        assert not reader.is_alive() and read == [] and forked.children == {}, delay
        assert [child.exitcode for child in children] == [-signal.SIGKILL] * 2, delay


# ----------------------------------------------------------------------------- decode check cache


def check_pass(folder: Path, cache: Path, monkeypatch, rank: int = 0, world_size: int = 1):
    """One decode check of ``folder``'s few images (checked by its thread, in this process):
    (the rows it decodes, which rows it knows, ``{row: why}`` of its own results)."""
    decoded: list[int] = []
    real = ImageTable.problem
    monkeypatch.setattr(ImageTable, "problem", lambda self, i: decoded.append(i) or real(self, i))
    images = {"training": folder_images(folder)}
    check = decode_check.DecodeCheck(images, None, rank, world_size, cache_dir=cache)
    check.wait()
    known = (images["training"].states.array != UNKNOWN).tolist()
    problems = dict(check.problems["training"])
    if world_size == 1:
        assert check.finish() == {
            images["training"].table.location(i): problems[i] for i in problems
        }
    return sorted(decoded), known, problems


def test_decode_check_is_remembered_per_image_and_shared_out(tmp_path: Path, monkeypatch):
    folder = write_image_folder(tmp_path / "train", ["a"], 3)
    (folder / "a" / "broken.jpg").write_bytes(b"not a jpeg")  # row 0, before img_000..002
    cache = tmp_path / "logs"

    assert check_pass(folder, cache, monkeypatch)[0::2] == ([0, 1, 2, 3], {0: ANY})
    # The next start decodes nothing and knows every row.
    assert check_pass(folder, cache, monkeypatch) == ([], [True] * 4, {0: ANY})

    image = folder / "a" / "img_000.jpg"  # row 1
    image.write_bytes(b"broken too")  # a new size and time: checked again, alone
    assert check_pass(folder, cache, monkeypatch)[0::2] == ([1], {0: ANY, 1: ANY})

    (cache / decode_check.DecodeCheckCache.NAME).write_text("{damaged")  # checked again, all
    assert check_pass(folder, cache, monkeypatch)[0] == [0, 1, 2, 3]

    shutil.copy(folder / "a" / "img_001.jpg", folder / "a" / "img_new.jpg")
    assert check_pass(folder, cache, monkeypatch)[0] == [0, 1, 2, 3, 4]  # a new listing

    # Rank 1 of 2, the cache gone: it decodes its share, every other row.
    (cache / decode_check.DecodeCheckCache.NAME).unlink()
    decoded, known, problems = check_pass(folder, cache, monkeypatch, rank=1, world_size=2)
    assert decoded == [1, 3] and known == [False, True, False, True, False]
    assert list(problems) == [1]


def test_a_check_of_many_images_runs_in_processes_and_is_remembered(tmp_path: Path, monkeypatch):
    import multiprocessing

    folder = write_image_folder(tmp_path / "train", ["a", "b"], 150, size=8)
    for name in ("a/img_007.jpg", "b/img_100.jpg"):
        (folder / name).write_bytes(b"broken")
    decodes = multiprocessing.get_context("fork").Value("i", 0)  # counted in every process
    real = ImageTable.problem

    def counted(self, i):
        with decodes.get_lock():
            decodes.value += 1
        return real(self, i)

    monkeypatch.setattr(ImageTable, "problem", counted)
    for start, decoded in (("cold", 300), ("warm", 0)):
        images = {"training": folder_images(folder)}
        check = decode_check.DecodeCheck(images, None, cache_dir=tmp_path / "logs", workers=2)
        assert check.pool is not None, start  # forked processes, not this one's thread
        found = check.finish()
        assert sorted(Path(p).relative_to(folder).as_posix() for p in found) == [
            "a/img_007.jpg",
            "b/img_100.jpg",
        ]
        states = images["training"].states.array
        assert (states == UNREADABLE).sum() == 2 and (states == READABLE).sum() == 298
        assert decodes.value == decoded, start
        decodes.value = 0


def test_a_check_process_that_ends_early_leaves_its_share_to_the_rank(
    tmp_path: Path, monkeypatch, caplog
):
    """multiprocessing's Pool waits forever for the result of a process that was killed (and
    deadlocked on its queue's lock when ending a pool whose replacement child died waiting
    for a task, which hung CI): the check's own thread checks the lost process's share."""
    folder = write_image_folder(tmp_path / "train", ["a", "b"], 150, size=8)
    (folder / "b" / "img_100.jpg").write_bytes(b"broken")
    parent, real = os.getpid(), decode_check.DecodeCheck.rows

    def killed_in_a_child(self, role, start, stop):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return real(self, role, start, stop)

    monkeypatch.setattr(decode_check.DecodeCheck, "rows", killed_in_a_child)
    images = {"training": folder_images(folder)}
    check = decode_check.DecodeCheck(images, None, workers=1)
    assert check.pool is not None
    found = check.finish()
    assert [Path(p).relative_to(folder).as_posix() for p in found] == ["b/img_100.jpg"]
    assert "ended early (signal 9): this process checked its share" in caplog.text


def test_an_error_inside_the_check_ends_the_run_with_one_line_naming_it(
    tmp_path: Path, monkeypatch
):
    folder = write_image_folder(tmp_path / "train", ["a"], 3)

    def broken(self, i):
        raise ValueError("a bug in the check")

    monkeypatch.setattr(ImageTable, "problem", broken)
    check = decode_check.DecodeCheck({"training": folder_images(folder)}, None)
    with pytest.raises(RuntimeError) as raised:
        check.finish()
    assert lifecycle.bug_line(raised.value) == (
        "RuntimeError: the images' decode check failed: ValueError: a bug in the check"
    )
    assert isinstance(raised.value.__cause__, ValueError)  # its traceback follows the line


def test_row_stats_of_files_and_shards(tmp_path: Path):
    folder = write_image_folder(tmp_path / "train", ["a"], 3)
    table = folder_images(folder).table
    (folder / "a" / "img_002.jpg").unlink()
    stats = decode_check.row_stats(table, 0, 3)
    for i in range(2):
        st = os.stat(table.location(i))
        assert list(stats[i]) == [st.st_size, st.st_mtime_ns]
    assert list(stats[2]) == [-1, -1]
    shard = replace(table, kind=TAR, containers=[str(tmp_path / "s.tar")])
    (tmp_path / "s.tar").write_bytes(b"x" * 7)
    assert decode_check.row_stats(shard, 0, 3)[:, 0].tolist() == [7, 7, 7]


# ----------------------------------------------------------------------------- class folders


def folder_with_junk(root: Path) -> Path:
    write_image_folder(root, ["cat", "dog"], 2)
    for junk in ("__MACOSX", ".thumbnails"):
        (root / junk / "cat").mkdir(parents=True)
        write_image_folder(root / junk, ["cat"], 1)
    return root


def test_hidden_folders_and_macosx_are_never_classes(tmp_path: Path):
    import imgtrainer.tools.predict as predict
    import imgtrainer.tools.prepare_data as prepare_data

    root = folder_with_junk(tmp_path / "train")
    assert find_classes(root, "training") == ["cat", "dog"]
    assert folder_images(root).classes == ["cat", "dog"]
    assert [p.name for p in class_folders(root)] == ["cat", "dog"]  # what prepare_data uses
    assert prepare_data.find_class_root(root) == root
    assert all(
        "__MACOSX" not in p.parts and ".thumbnails" not in p.parts
        for p in predict.collect_images([root])
    )
    assert len(predict.collect_images([root])) == 4


# ----------------------------------------------------------------------------- rank endings


def run_rank(tmp_path: Path, body: str, rank: int = 1) -> tuple[int, list[dict], str]:
    """Run ``lifecycle.run_reporting`` on a main built from ``body`` in a fresh process, as a
    rank under the launcher; returns its exit code, the reports and its stderr."""
    reports = tmp_path / f"reports_{rank}"
    reports.mkdir(exist_ok=True)
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(SRC)!r})\n"
        "from imgtrainer.errors import UserError\n"
        "from imgtrainer.run.lifecycle import run_reporting\n"
        "def main():\n"
        f"    {body}\n"
        "sys.exit(run_reporting(main))\n"
    )
    env = {**os.environ, lifecycle.REPORT_DIR_ENV: str(reports), "RANK": str(rank)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    return result.returncode, lifecycle.read_outcomes(reports), result.stderr


def test_rank_reports_bad_input_bug_and_early_stop(tmp_path: Path):
    code, reports, stderr = run_rank(tmp_path, "raise UserError('no such folder data/x')")
    assert code == 2 and reports[0]["line"] == "error: no such folder data/x"
    assert reports[0]["rank"] == 1 and "error: no such folder" in stderr  # in the rank's own log

    code, reports, _ = run_rank(tmp_path, "return {}['missing']", rank=0)
    assert code == 1 and "KeyError: 'missing'" in reports[0]["traceback"]

    # CUDA errors end their message with hints; the line is the error's type and first line.
    code, reports, _ = run_rank(
        tmp_path, "raise RuntimeError('CUDA error: initialization error\\nCompile with X')"
    )
    assert (
        code == 1 and reports[0]["line"] == "error: RuntimeError: CUDA error: initialization error"
    )

    code, reports, _ = run_rank(
        tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGTERM)", rank=2
    )
    assert code == 143 and "before training started" in reports[0]["line"]


def test_a_stop_signal_while_a_failed_rank_ends_leaves_its_ending_whole(tmp_path: Path):
    """torchrun stops the other ranks of a failed attempt with SIGTERM: one that came while a
    rank wrote its own failure escaped run_reporting, and the rank then waited in
    multiprocessing's exit for its loader workers until torchrun's SIGKILL, 30 s later."""
    code, reports, _ = run_rank(
        tmp_path,
        "import os, signal, imgtrainer.run.lifecycle as lifecycle\n"
        "    real = lifecycle.bug_line\n"
        "    def stopped_now(err):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # as torchrun's, during the report\n"
        "        return real(err)\n"
        "    lifecycle.bug_line = stopped_now\n"
        "    raise RuntimeError('Connection closed by peer')",
    )
    assert code == 1 and reports[0]["line"] == "error: RuntimeError: Connection closed by peer"
    # A stop that interrupts a failing rank's clean-up: the failure is still why it ended.
    code, reports, _ = run_rank(
        tmp_path,
        "import os, signal\n"
        "    try:\n"
        "        raise RuntimeError('Connection closed by peer')\n"
        "    finally:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)",
        rank=3,
    )
    assert code == 1 and "RuntimeError: Connection closed" in reports[0]["traceback"]


def test_the_line_of_a_bug_raised_in_a_loader_worker_is_the_original_error():
    from torch.utils.data._utils import ExceptionWrapper

    try:
        {}["zebra"]
    except KeyError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(KeyError) as raised:
        wrapped.reraise()  # as the DataLoader re-raises it in the training process
    assert "Caught KeyError" in str(raised.value)
    assert lifecycle.bug_line(raised.value) == "KeyError: 'zebra'"


def outcome(rank: int, code: int, at: float, line: str = "", trace: str = "") -> dict:
    return {"rank": rank, "attempt": 0, "code": code, "line": line, "traceback": trace, "time": at}


def test_launcher_prints_the_first_failure_once(capsys):
    log = Path("logs/torchrun.log")
    outcomes = [
        outcome(0, 143, 1.0),
        outcome(1, 2, 0.5, "error: bad folder"),
        outcome(0, 1, 0.9, "error: RuntimeError: peer closed", "Traceback ...\n"),
    ]
    outcomes.sort(key=lambda o: o["time"])
    assert run_outcome.exit_code(1, outcomes, [], log) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: rank 1: bad folder (torchrun's report and every rank's stderr: {log})"
    ]

    bug = [
        outcome(
            1, 1, 0.2, "error: KeyError: 'x'", "Traceback (most recent call last):\nKeyError: 'x'\n"
        )
    ]
    assert run_outcome.exit_code(1, bug, [], log) == 1
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "error: rank 1: KeyError: 'x'" in err


def test_launcher_exit_codes_after_signals_and_silent_failures(capsys):
    log = Path("logs/torchrun.log")
    stopped = [outcome(0, 130, 1.0), outcome(1, 130, 1.0)]
    assert run_outcome.exit_code(1, stopped, [signal.SIGINT], log) == 130
    assert run_outcome.exit_code(1, [outcome(0, 143, 1.0)], [], log) == 143  # SIGTERM to torchrun
    assert run_outcome.exit_code(1, [], [signal.SIGHUP], log) == 143
    assert capsys.readouterr().err == ""
    assert run_outcome.exit_code(0, [outcome(0, 0, 1.0)], [], log) == 0
    # A node joined: the agent stopped its rank (143, the same restart count), whose new rank
    # in the next round is another; torchrun's 0 is the run's.
    joined = [
        outcome(0, 143, 1.0, "Stopped at epoch 1, step 2; resume with ..."),
        outcome(1, 0, 2.0),
    ]
    assert run_outcome.exit_code(0, joined, [], log) == 0
    assert run_outcome.exit_code(1, [], [], log) == 1
    assert "no rank said why" in capsys.readouterr().err


def test_read_outcomes_keeps_the_last_torchrun_attempt(tmp_path: Path):
    for rank, attempt, code in ((0, 0, 1), (1, 0, 2), (0, 1, 0), (1, 1, 0)):
        (tmp_path / f"rank{rank}.attempt{attempt}.json").write_text(
            json.dumps(outcome(rank, code, float(rank)) | {"attempt": attempt})
        )
    assert [o["code"] for o in lifecycle.read_outcomes(tmp_path)] == [0, 0]


def test_loader_workers_ignore_stop_signals_in_a_forked_worker():
    """As the DataLoader starts a worker: forked from a process that imported torch already."""
    from imgtrainer.data.loaders import quiet_loader_worker

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: exit code 1 unless it gets past the three signals
        code = 1
        try:
            os.close(read)
            quiet_loader_worker(0)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                os.kill(os.getpid(), sig)
            os.write(write, b"still here")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and said == b"still here", status


@pytest.mark.slow
def test_loader_workers_ignore_stop_signals(tmp_path: Path):
    """The same in a new interpreter (seconds: it imports torch)."""
    code = (
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(SRC)!r})\n"
        "from imgtrainer.data.loaders import quiet_loader_worker\n"
        "quiet_loader_worker(0)\n"
        "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
        "    os.kill(os.getpid(), sig)\n"
        "print('still here')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "still here" in result.stdout, result.stderr


def test_sighup_stops_like_sigterm():
    """A closed terminal: the same agreed stop with a checkpoint, and exit code 143."""
    from imgtrainer.training.stopping import StopRequest

    stop = StopRequest(distributed=False)
    with stop.installed():
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.agreed()
    assert stop.exit_code == 143


def test_a_stop_signal_after_training_lets_the_run_finish_its_files(caplog):
    """Training has ended: the signal is noted, nothing is raised (the last files are written
    and a finished run ends 0); the launcher then reports 0, though it passed a signal on."""
    from imgtrainer.training.stopping import StopRequest

    stop = StopRequest(distributed=False)
    previous = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)}
    try:
        with stop.installed():
            pass
        stop.installed_for_wrap_up()
        with caplog.at_level(logging.WARNING):
            os.kill(os.getpid(), signal.SIGTERM)
        assert "training has ended; writing the run's last files" in caplog.text
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    log = Path("unused.log")
    finished = [outcome(0, 0, 1.0), outcome(1, 0, 1.1)]
    assert run_outcome.exit_code(0, finished, [signal.SIGTERM], log) == 0
    stopped = [outcome(0, 143, 1.0), outcome(1, 143, 1.1)]
    assert run_outcome.exit_code(0, stopped, [signal.SIGTERM], log) == 143
    assert run_outcome.exit_code(0, [], [signal.SIGTERM], log) == 143


def test_the_launcher_counts_images_only_as_far_as_its_checks_need(tmp_path: Path):
    from imgtrainer.data.layouts.folder_checks import count_images

    folder = write_image_folder(tmp_path / "train", ["a", "b", "c"], 5)
    (folder / "d").mkdir()
    classes = ["a", "b", "c", "d"]
    assert count_images(folder, classes) == {"a": 5, "b": 5, "c": 5, "d": 0}
    assert count_images(folder, classes, enough=7) == {"a": 5, "b": 2, "c": 1, "d": 0}
    assert count_images(folder, classes, enough=0) == {"a": 1, "b": 1, "c": 1, "d": 0}
    assert count_images(folder, classes, enough=99) == {"a": 5, "b": 5, "c": 5, "d": 0}


def _worker_ignoring_sigterm() -> None:  # as data.quiet_loader_worker makes them
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)


def test_the_ending_kills_loader_workers_left_alive_that_multiprocessing_would_wait_for():
    """A rank whose epoch iterator was never shut down still has loader workers when its main
    returns; they ignore SIGTERM, so multiprocessing's exit (SIGTERM, then join) would wait for
    them for ever (a finished hang-matrix run held its launcher so). ``ending_of`` kills them
    all, though a loader's SIGCHLD handler raises at the first one killed (as torch's does)."""
    handlers = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGCHLD)}

    def loader_sigchld(signum, frame):
        raise RuntimeError("DataLoader worker is killed by signal: Killed.")

    fork = multiprocessing.get_context("fork")
    workers = [fork.Process(target=_worker_ignoring_sigterm, daemon=True) for _ in range(2)]
    for worker in workers:
        worker.start()
    signal.signal(signal.SIGCHLD, loader_sigchld)
    try:
        assert lifecycle.ending_of(lambda: 0) == (0, "", "")
        assert [w.exitcode for w in workers] == [-signal.SIGKILL] * 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for worker in workers:
            if worker.is_alive():
                worker.kill()

#!/usr/bin/env python
"""Chaos soak: a seeded random schedule of faults over a multi-epoch 2-process CPU run through
the launcher, and what each fault cost; at the end, whether the run trained every epoch once and
ended with the weights of an unfaulted run, bit for bit.

    python bench/chaos.py --faults 50 --epochs 60         # a long soak (about 10 minutes here)
    python bench/chaos.py --faults 4 --epochs 3 --seed 7  # a short one; any seed replays

The faults, a random order of every kind in turn: SIGKILL of a rank, of a loader worker, or of
the whole job (launcher, torchrun, ranks, workers; then the same command again); SIGSTOP of a
rank or of a loader worker (the launcher's hang watchdog must name it and restart the workers);
SIGTERM to the launcher (a stop with a checkpoint), then the same command again; a full disk
under the checkpoint folder until the run met it at a checkpoint (a small tmpfs there, in a
user and mount namespace of this process: ``unshare -rm``, no root needed; left out, and said
so, where the kernel does not allow it). Each comes at a global step that the seed chose in its
own share of the run's steps, where the ranks wait for it (tests/fault_injection/step_gate.py):
no machine is too fast or too slow for the schedule. The command is the same every time, with
``--resume auto``: a relaunch continues from the newest checkpoint.

Prints a line per fault (the global step it came at, the step the run resumed from: the steps
trained again, the seconds from the fault to the resumed line and to training past that step
again), a table by kind (injected, survived, restarts, steps redone), every epoch once or not,
the final weights and optimizer state against the unfaulted run's (run beside it), and the
command that replays the seed. Exit code 0 when every fault was survived and the end is
bitwise the unfaulted run's, else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support/, fault_injection/: shared with the tests

from fault_injection.step_gate import GATE_ENV, write_atomic  # noqa: E402
from imgtrainer.heartbeat import (  # noqa: E402
    HEARTBEAT_DIR_ENV,
    Beat,
    Phase,
    SlotName,
    read_slot,
)
from support.harness import descendants, launcher_command, write_image_folder  # noqa: E402

KINDS = (
    "kill rank",
    "kill worker",
    "kill job",
    "stop rank",
    "stop worker",
    "term launcher",
    "disk full",
)
# Kinds after which the same command is launched again (the launcher has ended).
RELAUNCHED = ("kill job", "term launcher")
RANKS, STEPS_PER_EPOCH = 2, 8  # trainer_flags: 264 training images, 16 per process
NO_GATE = 1 << 40  # a step no run reaches: after the last fault, the run trains to its end
IN_NAMESPACE_ENV = "CHAOS_IN_NAMESPACE"
TMPFS_MB = 64  # the checkpoint folder's size under "disk full": a few checkpoints' worth
FAULT_TIMEOUT = 180.0  # seconds for a fault's recovery before it counts as not survived
POLL = 0.05


# ----------------------------------------------------------------------------- the run's processes


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def heartbeat_folder(launcher: int) -> Path | None:
    """The launcher's heartbeat folder, from the environment of a process it started."""
    for pid in descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(HEARTBEAT_DIR_ENV.encode() + b"="):
                return Path(entry.split(b"=", 1)[1].decode())
    return None


@dataclass
class Job:
    """One launcher run of the soak's command, its output appended to files of the run."""

    command: list[str]
    cwd: Path
    launch: int
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen = field(init=False)
    folder: Path | None = None

    def __post_init__(self):
        with (
            open(self.cwd / "launcher.out", "a") as out,
            open(self.cwd / "launcher.err", "a") as err,
        ):
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
            self.process = subprocess.Popen(
                self.command, cwd=self.cwd, stdout=out, stderr=err, env=env
            )

    def slots(self) -> dict[SlotName, Beat]:
        """The slots of this job's live processes."""
        if self.folder is None:
            self.folder = heartbeat_folder(self.process.pid)
            if self.folder is None:
                return {}
        found = {}
        for path in self.folder.glob("*.hb"):
            name = SlotName.parse(path.name)
            if name is not None and alive(name.pid):
                beat = read_slot(path)
                if beat is not None:
                    found[name] = beat
        return found

    def training(self) -> tuple[int, int] | None:
        """(attempt, global step) of the newest attempt whose ranks all train (their step
        marked), or None while none does."""
        ranks = [(n, b) for n, b in self.slots().items() if n.is_rank]
        if not ranks:
            return None
        attempt = max(n.attempt for n, _ in ranks)
        beats = [b for n, b in ranks if n.attempt == attempt]
        if len(beats) < 2 or any(b.phase in (Phase.NOT_STARTED, Phase.DONE) for b in beats):
            return None
        return attempt, max(b.step for b in beats)

    def newest_attempt(self) -> int:
        """The newest torchrun attempt that has a live rank (-1 while none has)."""
        return max((n.attempt for n in self.slots() if n.is_rank), default=-1)

    def processes(self, kind: str) -> list[SlotName]:
        """The live processes of the newest attempt: its ranks ("rank") or loader workers."""
        slots = [n for n in self.slots() if n.kind in ("w", "v") or n.is_rank]
        if not slots:
            return []
        attempt = max(n.attempt for n in slots)
        wanted = [n for n in slots if n.attempt == attempt]
        return [n for n in wanted if n.is_rank == (kind == "rank")]

    def kill_all(self) -> None:
        """SIGKILL to the launcher and everything it started, at once (a lost machine)."""
        pids = [self.process.pid, *descendants(self.process.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()

    @property
    def ended(self) -> int | None:
        return self.process.poll()


# ----------------------------------------------------------------------------- faults


@dataclass
class Fault:
    index: int
    kind: str
    target: str = ""
    at_wall: float = 0.0
    at_step: int | None = None
    attempt: int = 0
    launch: int = 0
    resumed_step: int | None = None
    to_resumed: float | None = None
    to_recovered: float | None = None
    restarts: int = 0  # torchrun restarts and relaunches until training went on
    survived: bool = False
    note: str = ""

    @property
    def redone(self) -> int | None:
        if self.at_step is None or self.resumed_step is None:
            return None
        return max(0, self.at_step - self.resumed_step)


class FullDisk:
    """A tmpfs under the checkpoint folder (in this process's own mount namespace) that a
    filler file fills for a moment."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(folder)], check=True
        )
        self.filler = folder / ".chaos-filler"

    def fill(self) -> None:
        """Write until no byte fits: blocks of 1 MiB, then of a page."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for size in (1 << 20, 4096):
                block = b"\0" * size
                try:
                    while True:
                        os.write(fd, block)
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", str(self.folder)], check=False)


class Gate:
    """Where the run's ranks wait for the next fault (tests/fault_injection/step_gate.py): at the
    first global step at or after ``step`` of a torchrun attempt at or after ``attempt``."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.step = NO_GATE

    @property
    def env(self) -> dict[str, str]:
        path = [str(ROOT / "tests" / "fault_injection"), os.environ.get("PYTHONPATH", "")]
        return {
            GATE_ENV: str(self.folder),
            "IMGTRAINER_HOOKS": "step_gate:hold_at_gate",
            "PYTHONPATH": os.pathsep.join(filter(None, path)),
        }

    def open(self, step: int, attempt: int) -> None:
        """The next gate; ranks held at the last one go on."""
        self.step = step
        write_atomic(self.folder / "gate", f"{step} {attempt}")

    def held(self) -> tuple[int, int] | None:
        """(attempt, global step) where every rank holds at this gate, else None."""
        found = set()
        for rank in range(RANKS):
            try:
                text = (self.folder / f"held.rank{rank}").read_text()
                gate, attempt, step = (int(v) for v in text.split())
            except (OSError, ValueError):
                return None
            if gate != self.step:
                return None
            found.add((attempt, step))
        return found.pop() if len(found) == 1 else None


def namespace_ok() -> str | None:
    """None when ``unshare -rm`` can make this process a mount namespace of its own, else why
    not."""
    if not shutil.which("unshare"):
        return "no unshare command"
    done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    return None if done.returncode == 0 else done.stderr.strip() or "unshare -rm failed"


# ----------------------------------------------------------------------------- the soak


def log_times(path: Path, phrase: str) -> list[tuple[float, str]]:
    """(wall-clock time, line) of the lines of a log that hold ``phrase``."""
    found = []
    if not path.exists():
        return found
    for line in path.read_text(errors="replace").splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", line)
        if match and phrase in line:
            stamp = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
            found.append((stamp.timestamp(), line))
    return found


RESUMED = re.compile(r"Resumed from \S+: epoch (\d+), step (\d+) of (\d+)")


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path, command: list[str]):
        self.args, self.workdir, self.command = args, workdir, command
        self.run_dir = workdir / "chaos"
        self.gate = Gate(self.run_dir / "gate")
        self.rng = random.Random(args.seed)
        self.faults: list[Fault] = []
        self.launches = 0
        self.job: Job | None = None
        self.disk: FullDisk | None = None
        self.say: Callable[[str], None] = lambda text: print(text, flush=True)

    def relaunch(self, next_step: int) -> None:
        """The same command again, held at ``next_step`` (its attempts count from 0 again)."""
        self.gate.open(next_step, 0)
        self.launch()

    def launch(self) -> Job:
        self.launches += 1
        self.job = Job(self.command, self.run_dir, self.launches, self.gate.env)
        return self.job

    def schedule(self) -> list[str]:
        kinds = [k for k in KINDS if k != "disk full" or self.disk is not None]
        order: list[str] = []
        while len(order) < self.args.faults:
            block = list(kinds)
            self.rng.shuffle(block)
            order += block
        return order[: self.args.faults]

    def fault_steps(self) -> list[int]:
        """A global step for each fault, one in each equal share of the run's steps (the last
        step left out), early enough in its share for a full disk's checkpoint before the
        next share begins (``disk_full_moment``)."""
        share = self.share(self.args)
        window = self.args.save_every_steps
        return [i * share + 1 + self.rng.randrange(share - window) for i in range(self.args.faults)]

    @staticmethod
    def share(args: argparse.Namespace) -> int:
        return (args.epochs * STEPS_PER_EPOCH - 1) // args.faults

    def run(self) -> None:
        kinds, steps = self.schedule(), self.fault_steps()
        self.gate.open(steps[0], 0)
        self.launch()
        for index, kind in enumerate(kinds, 1):
            held = self.wait_held()
            fault = None if held is None else self.inject(index, kind, held)
            if fault is None:
                self.say(f"  the run ended before fault {index}: {len(self.faults)} faults")
                break
            self.recover(fault, steps[index] if index < len(steps) else NO_GATE)
            self.faults.append(fault)
            self.say("  " + fault_line(fault))
        self.finish()

    def wait_held(self) -> tuple[int, int] | None:
        """(attempt, global step) once the ranks hold at the gate; None when the run ended."""
        deadline = time.monotonic() + FAULT_TIMEOUT
        while time.monotonic() < deadline:
            if self.job.ended is not None:
                return None
            held = self.gate.held()
            if held is not None:
                return held
            time.sleep(POLL)
        raise TimeoutError

    def wait_training(self, after: tuple[int, int, int]) -> tuple[int, int] | None:
        """Wait until the job trains past ``after``'s (launch, attempt, step): at a later step
        of a newer attempt or launch; its (attempt, step), or None when it ended."""
        deadline = time.monotonic() + FAULT_TIMEOUT
        while time.monotonic() < deadline:
            job = self.job
            if job.ended is not None:
                return None
            now = job.training()
            if now is not None:
                launch, old_attempt, old_step = after
                if (job.launch, now[0]) > (launch, old_attempt) and now[1] > old_step:
                    return now
            time.sleep(POLL)
        raise TimeoutError

    def inject(self, index: int, kind: str, held: tuple[int, int]) -> Fault | None:
        job = self.job
        fault = Fault(index, kind, attempt=held[0], at_step=held[1], launch=job.launch)
        if kind in ("kill rank", "stop rank", "kill worker", "stop worker"):
            who = "rank" if "rank" in kind else "worker"
            choices = job.processes(who)
            if not choices:
                return None
            target = self.rng.choice(sorted(choices, key=lambda n: (n.rank, n.kind, n.worker)))
            fault.target = f"{target.who} (pid {target.pid})"
            fault.at_wall = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(target.pid, signal.SIGKILL if "kill" in kind else signal.SIGSTOP)
        elif kind == "kill job":
            fault.target, fault.at_wall = "the launcher and all it started", time.time()
            job.kill_all()
        elif kind == "term launcher":
            fault.target, fault.at_wall = f"launcher (pid {job.process.pid})", time.time()
            job.process.send_signal(signal.SIGTERM)
        else:  # disk full
            fault.target, fault.at_wall = f"tmpfs {self.disk.folder.name}/", time.time()
            self.disk.fill()
        return fault

    def recover(self, fault: Fault, next_step: int) -> None:
        """Wait for the run to train past the fault's step again (relaunching the command where
        the fault ended the launcher), the gate open at ``next_step`` for an attempt after the
        fault's; what it cost."""
        before = (fault.launch, fault.attempt, fault.at_step)
        job = self.job
        try:
            now = self.disk_full_moment(fault, next_step) if fault.kind == "disk full" else None
            if fault.kind in RELAUNCHED:
                code = job.process.wait(timeout=FAULT_TIMEOUT)
                fault.note = f"launcher exit {code}; the same command again"
                self.relaunch(next_step)
            elif fault.kind != "disk full":
                self.gate.open(next_step, fault.attempt + 1)
            if now is None:
                now = self.wait_training(before)
            if now is None and self.job.ended == 0:
                fault.survived, fault.note = True, (fault.note or "the run finished")
                return
            if now is None:
                fault.note = f"launcher exit {self.job.ended}: not survived; the same command again"
                self.relaunch(next_step)
                now = self.wait_training(before)
            else:
                fault.survived = True
        except (TimeoutError, subprocess.TimeoutExpired):
            fault.note = "no progress: not survived; killed, the same command again"
            self.job.kill_all()
            self.relaunch(next_step)
            now = self.wait_training(before)
        fault.to_recovered = time.time() - fault.at_wall
        fault.restarts = (self.job.launch - fault.launch) + (
            now[0] if self.job.launch != fault.launch else now[0] - fault.attempt
        )
        self.resumed(fault)

    def disk_full_moment(self, fault: Fault, next_step: int) -> tuple[int, int] | None:
        """The disk stays full until the run passed a checkpoint (held ``--save_every_steps``
        steps later: every such window holds one), restarted or ended; then freed, and the
        gate opened at ``next_step`` (relaunching the command where the launcher ended).
        (attempt, step) where the run went on unharmed, else None."""
        job = self.job
        self.gate.open(fault.at_step + self.args.save_every_steps, fault.attempt)
        deadline = time.monotonic() + FAULT_TIMEOUT
        held = None
        while job.ended is None and job.newest_attempt() <= fault.attempt:
            held = self.gate.held()
            if held is not None or time.monotonic() > deadline:
                break
            time.sleep(POLL)
        self.disk.free()
        if job.ended is not None:
            fault.note = f"launcher exit {job.ended} (the disk was full); the same command again"
            self.relaunch(next_step)
        else:
            self.gate.open(next_step, fault.attempt + (held is None))
        return held

    def resumed(self, fault: Fault) -> None:
        """The first "Resumed from" line between the fault and training past it again: the
        step the run continued from."""
        end = fault.at_wall + (fault.to_recovered or 0.0) + 0.01
        for when, line in log_times(self.run_dir / "logs" / "train_rank_0.log", "Resumed from"):
            if fault.at_wall - 0.01 <= when <= end:  # the log's clock is this one, to the ms
                epoch, step, steps = (int(g) for g in RESUMED.search(line).groups())
                fault.resumed_step = (epoch - 1) * steps + step
                fault.to_resumed = when - fault.at_wall
                return
        if fault.restarts:  # restarted before its first checkpoint: from the start
            fault.resumed_step = 0
            fault.note = (fault.note + "; " if fault.note else "") + "no checkpoint yet"
        else:
            fault.resumed_step = fault.at_step  # nothing trained again
            fault.note = (fault.note + "; " if fault.note else "") + "no restart"

    def finish(self) -> None:
        """The run to its end (once more with the same command if it ended otherwise)."""
        self.gate.open(NO_GATE, 0)
        for _ in range(3):
            code = self.job.process.wait(timeout=FAULT_TIMEOUT * 4)
            if code == 0:
                return
            self.say(f"  launcher exit {code} after the faults: the same command again")
            self.launch()
        raise SystemExit("the run did not finish after the faults")


def fault_line(f: Fault) -> str:
    def seconds(value: float | None) -> str:
        return f"{value:5.1f}" if value is not None else "    -"

    resumed = f"{f.resumed_step:4d}" if f.resumed_step is not None else "   -"
    redone = f"{f.redone:3d}" if f.redone is not None else "  -"
    return (
        f"{f.index:3d} {f.kind:13} step {f.at_step:4d} -> resumed {resumed}: redone {redone}, "
        f"resumed line {seconds(f.to_resumed)} s, trained past it {seconds(f.to_recovered)} s, "
        f"restarts {f.restarts}, {'survived' if f.survived else 'NOT SURVIVED'}  "
        f"[{f.target}{'; ' + f.note if f.note else ''}]"
    )


def table(faults: list[Fault]) -> list[str]:
    rows = [
        f"  {'kind':13} {'injected':>8} {'survived':>8} {'restarts':>8} "
        f"{'redone mean':>11} {'max':>4} {'to resume s':>11} {'to train s':>10}"
    ]
    for kind in [*KINDS, "all"]:
        group = [f for f in faults if kind in (f.kind, "all")]
        if not group:
            continue
        redone = [f.redone for f in group if f.redone is not None]
        to_resume = [f.to_resumed for f in group if f.to_resumed is not None]
        to_train = [f.to_recovered for f in group if f.to_recovered is not None]

        def mean(values):
            return sum(values) / len(values) if values else float("nan")

        rows.append(
            f"  {kind:13} {len(group):8d} {sum(f.survived for f in group):8d} "
            f"{sum(f.restarts for f in group):8d} {mean(redone):11.1f} "
            f"{max(redone, default=0):4d} {mean(to_resume):11.1f} {mean(to_train):10.1f}"
        )
    return rows


def compare(run: Path, reference: Path) -> tuple[bool, str]:
    """Every epoch once, and the final checkpoint's weights and optimizer state bit for bit."""
    import torch

    history = json.loads((run / "logs" / "training_history.json").read_text())
    epochs = [record["epoch"] for record in history["epochs"]]
    ref_history = json.loads((reference / "logs" / "training_history.json").read_text())
    once = epochs == [record["epoch"] for record in ref_history["epochs"]]
    a = torch.load(run / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    b = torch.load(reference / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
    tensors = differ = 0

    def walk(x, y) -> None:
        nonlocal tensors, differ
        if isinstance(x, torch.Tensor):
            tensors += 1
            differ += not (isinstance(y, torch.Tensor) and torch.equal(x, y))
        elif isinstance(x, dict):
            differ += x.keys() != y.keys()
            for key in x.keys() & y.keys():
                walk(x[key], y[key])
        elif isinstance(x, list | tuple):
            differ += len(x) != len(y)
            for u, v in zip(x, y, strict=False):
                walk(u, v)

    for key in ("model_state_dict", "optimizer_state_dict"):
        walk(a[key], b[key])
    text = (
        f"every epoch once: {'yes' if once else 'NO'} ({len(epochs)} epochs: {epochs[:3]}...)\n"
        f"final weights and optimizer state vs the unfaulted run: "
        f"{'bitwise equal' if not differ else f'{differ} DIFFER'} ({tensors} tensors)"
    )
    return once and not differ, text


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="the schedule's seed (random)")
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--save_every_steps", type=int, default=3)
    parser.add_argument("--hang_timeout", default="4s")
    parser.add_argument("--no_disk", action="store_true", help="leave out the full disk")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="kept (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    if Soak.share(args) <= args.save_every_steps:
        parser.error(
            f"--faults {args.faults} over --epochs {args.epochs} ({STEPS_PER_EPOCH} steps each) "
            f"leave {Soak.share(args)} steps per fault; a full disk needs more than "
            f"--save_every_steps {args.save_every_steps}: give more epochs or fewer faults"
        )
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    return args


def trainer_flags(args: argparse.Namespace, data: Path) -> list[object]:
    """264 training images of 16 px, batch 16 per process: 8 steps per epoch; 297 images in all,
    so that the decode check runs in a process of its own; 2 loader workers per process."""
    return [
        "--device", "cpu", "--nproc", 2, "--train_dir", data / "train", "--val_dir", data / "val",
        "--image_size", 16, "--batch_size", 16, "--num_workers", 2, "--cache_images", "none",
        "--model", "test_resnet", "--learning_rate", 0.01, "--epochs", args.epochs,
        "--save_every_steps", args.save_every_steps, "--hang_timeout", args.hang_timeout,
        "--max_restarts", 1000, "--resume", "auto", "--log_interval", 4,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.no_disk and os.environ.get(IN_NAMESPACE_ENV) is None:
        why = namespace_ok()
        if why is None:  # again, as the root of a user and mount namespace of its own
            os.environ[IN_NAMESPACE_ENV] = "1"
            again = [*(argv if argv is not None else sys.argv[1:]), "--seed", str(args.seed)]
            os.execvp("unshare", ["unshare", "-rm", sys.executable, __file__, *again])
        print(f"no full disk in this soak: {why}")
        args.no_disk = True
    replay = (
        f"python bench/chaos.py --seed {args.seed} --faults {args.faults} --epochs {args.epochs}"
    )
    print(f"chaos soak, seed {args.seed} (replay: {replay})", flush=True)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="chaos_"))
        )
        return soak(args, workdir.resolve(), replay)


def soak(args: argparse.Namespace, workdir: Path, replay: str) -> int:
    data = workdir / "data"
    if not (data / "val").exists():
        write_image_folder(data / "train", ["cat", "dog", "fox"], 88, seed=1)
        write_image_folder(data / "val", ["cat", "dog", "fox"], 11, seed=2)
    command = launcher_command(*trainer_flags(args, data))
    for name in ("chaos", "unfaulted"):
        shutil.rmtree(workdir / name, ignore_errors=True)
        (workdir / name).mkdir(parents=True)
    started = time.monotonic()
    reference = Job(command, workdir / "unfaulted", 0)
    run = Soak(args, workdir, command)
    if not args.no_disk:
        run.disk = FullDisk(run.run_dir / "checkpoints")
    try:
        run.run()
        reference_code = reference.process.wait(timeout=FAULT_TIMEOUT * 4)
        if reference_code != 0:
            print(f"the unfaulted run failed (exit {reference_code}); see {workdir / 'unfaulted'}")
            return 1
        same, text = compare(run.run_dir, workdir / "unfaulted")
    finally:
        for job in (run.job, reference):
            if job is not None and job.ended is None:
                job.kill_all()
        if run.disk is not None:
            run.disk.close()
    faults = run.faults
    restarts = sum(f.restarts for f in faults)
    print(
        f"\n{len(faults)} faults injected, {sum(f.survived for f in faults)} survived, "
        f"{restarts} restarts ({run.launches - 1} relaunches of the command), "
        f"{time.monotonic() - started:.0f} s; steps trained again after each fault: "
        f"{[f.redone for f in faults]}"
    )
    print("\n".join(table(faults)))
    print(text)
    print(f"seed {args.seed}; replay: {replay}")
    return 0 if same and all(f.survived for f in faults) else 1


if __name__ == "__main__":
    sys.exit(main())

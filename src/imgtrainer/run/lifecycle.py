"""How the processes of one run stop together and report their endings to the launcher.

A parent-death signal down the chain launcher -> torchrun -> ranks -> loader workers; each rank
reports its ending in a JSON file in $TRAIN_DDP_REPORT_DIR; a rank exits without the
interpreter's teardown (docs/development.md: the processes of a run). No torch here: the
launcher imports this module.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from imgtrainer import redact
from imgtrainer.errors import (
    EXIT_RUN_FAILED,
    EXIT_USER_ERROR,
    RunFailed,
    UserError,
    first_line,
)
from imgtrainer.files import atomic_write
from imgtrainer.process import STOP_SIGNALS, TorchrunEnv, end_children, exit_code_for

REPORT_DIR_ENV = "TRAIN_DDP_REPORT_DIR"


# ----------------------------------------------------------------------------- rank outcomes


def report_dir() -> Path | None:
    folder = os.environ.get(REPORT_DIR_ENV)
    return Path(folder) if folder else None


def write_outcome(folder: Path, code: int, line: str = "", trace: str = "") -> None:
    """This rank's ending, for the launcher: written to a temporary file renamed into place."""
    env = TorchrunEnv.read()
    record = {
        "rank": env.rank,
        "attempt": env.restart_count,
        "code": code,
        "line": line,
        "traceback": trace,
        "time": time.time(),
    }
    path = folder / f"rank{env.rank}.attempt{env.restart_count}.json"
    text = redact.text(json.dumps(record)).encode()
    try:
        atomic_write(path, lambda f: f.write(text), lambda: len(text), tmp=path.with_suffix(".tmp"))
    except (OSError, UserError):
        pass  # the launcher then reports torchrun's exit code and points at the log


AGENT_REPORT = "agent.json"  # torchrun's agent's own failure, in the same folder
# Not failures of the agent: its workers' (the ranks report them) and its stop signals'.
NOT_AGENT_FAILURES = ("ChildFailedError", "SignalException", "KeyboardInterrupt")


def write_agent_failure(error: BaseException) -> None:
    """torchrun's agent failed itself (its rendezvous lost, timed out or closed): its one line,
    for the launcher, which would otherwise blame the rank whose failure the agent could not
    restart."""
    folder = report_dir()
    if folder is None or type(error).__name__ in NOT_AGENT_FAILURES:
        return
    try:
        line = first_line(error)
        if error.__cause__ is not None:
            line += f" ({first_line(error.__cause__)})"
        (folder / AGENT_REPORT).write_text(json.dumps({"line": line}))
    except OSError:
        pass  # the launcher then points at torchrun's log


def read_agent_failure(folder: Path) -> str | None:
    try:
        return json.loads((folder / AGENT_REPORT).read_text())["line"]
    except (OSError, ValueError, KeyError):
        return None


def read_outcomes(folder: Path) -> list[dict]:
    """The endings the ranks of the last torchrun attempt wrote, earliest first."""
    records = []
    for path in folder.glob("rank*.attempt*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return []
    last = max(r["attempt"] for r in records)
    return sorted((r for r in records if r["attempt"] == last), key=lambda r: r["time"])


class StoppedEarly(BaseException):
    """A stop signal that arrived before training started: there is nothing to save yet."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_reporting(main: Callable[[], int]) -> int:
    """Run a rank's ``main`` and return its exit code; under the launcher, also report it.

    Until training installs its own handlers (``stopping.StopRequest``), a stop signal ends the
    rank at once. A bad input is one ``error:`` line (exit 2), a diverged run one too (exit 1); a
    bug keeps its traceback. Under the launcher these go to this rank's stderr (the log folder)
    and to the report, and the launcher prints them once; the main rank's progress bar goes to
    the console (its stdout).
    """
    stop_at_once_until_training()
    folder = report_dir()
    if folder is not None and TorchrunEnv.read().rank == 0:
        sys.stderr = sys.stdout
    code, line, trace = ending_of(main)
    if folder is None:
        if trace:
            sys.stderr.write(trace)
        elif line:
            write_line(sys.stderr, line)
        return code
    # Under the launcher: the rank's own stderr is the log file; the launcher prints the line.
    if trace or line:
        write_line(sys.__stderr__, trace or line)
    write_outcome(folder, code, line, trace)
    return code


def stop_at_once_until_training() -> None:
    """A stop signal raises ``StoppedEarly`` in this process (not in a forked child that
    inherits the handler) until training installs its own handlers."""
    owner = os.getpid()

    def stop_at_once(signum: int, frame) -> None:
        if os.getpid() == owner:
            raise StoppedEarly(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_at_once)


def ending_of(main: Callable[[], int]) -> tuple[int, str, str]:
    """Run ``main``: its exit code, the one line that says why it ended ("" for none) and, for a
    bug, its traceback ("" otherwise). Once ``main`` has returned or raised, stop signals are
    ignored: torchrun stops the other ranks of a failed attempt with SIGTERM, and one that
    raised ``StoppedEarly`` while this rank wrote its ending escaped it, leaving the rank in
    multiprocessing's exit, waiting for its loader workers (which ignore SIGTERM) until
    torchrun's SIGKILL 30 s later. For the same reason, loader workers still alive then (an
    epoch's iterator that was never shut down) are killed: multiprocessing's exit would send
    them SIGTERM, which they ignore, and wait for them for ever."""
    try:
        try:
            code = main()
        finally:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            end_children(daemon_only=True)
    except BaseException as err:
        cause = err.__context__
        if isinstance(err, StoppedEarly) and isinstance(cause, Exception):
            err = cause  # the stop came while a failure ended the rank: the failure is why
        return ending_for(err)
    return code, "", ""


def ending_for(err: BaseException) -> tuple[int, str, str]:
    """``ending_of``'s exit code, line and traceback for an exception that ended ``main``."""
    if isinstance(err, UserError):
        return EXIT_USER_ERROR, f"error: {err}", ""
    if isinstance(err, RunFailed):
        return EXIT_RUN_FAILED, f"error: {err}", ""
    if isinstance(err, StoppedEarly | KeyboardInterrupt):
        signum = getattr(err, "signum", signal.SIGINT)
        line = f"stopped by {signal.Signals(signum).name} before training started; nothing to save"
        return exit_code_for(signum), line, ""
    if isinstance(err, SystemExit):
        code = err.code
        return (code if isinstance(code, int) else (0 if code is None else 1)), "", ""
    # A bug: its traceback, once.
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return 1, f"error: {bug_line(err)}", trace


def bug_line(err: BaseException) -> str:
    """``Type: first line of the message`` (CUDA errors append hints after their first line).
    An error that torch re-raises from a DataLoader worker ("Caught KeyError in DataLoader
    worker process 0. Original Traceback ...") gives the original's own last line instead."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if "Original Traceback (most recent call last):" in lines:
        return lines[-1]
    kind = type(err)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    return first_line(err, name=name)


def write_line(stream, text: str) -> None:
    """``text`` and its newline in one write: ranks sharing a terminal or a log file then never
    interleave within a line (``print`` writes the newline separately)."""
    stream.write(text.rstrip("\n") + "\n")
    stream.flush()


def exit_now(code: int) -> None:
    """Exit without Python's interpreter teardown (seconds after importing torch, for nothing:
    the run's files are written and the process group is destroyed); loader workers end with
    their parent (``die_with_parent``). A rank forked by torch elastic that succeeded exits
    through ``SystemExit(0)`` instead, its loader workers killed first: torch elastic waits for
    every rank's return value, and multiprocessing would wait for the workers, which ignore its
    SIGTERM (``data.loaders.quiet_loader_worker``).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    if code == 0 and multiprocessing.parent_process() is not None:
        end_children()
        raise SystemExit(0)
    os._exit(code)

"""Process helpers below every layer, without torch (the launcher imports them).

What torchrun tells a worker through its environment (read once), the signals that stop a run
and their exit codes, the parent-death signal that ends a chain of processes together, pools of
forked processes, and the GPUs a process started from here would see.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.pool
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each worker through its environment, read once per process and passed
    to whatever needs it; the defaults are a plain ``python`` run: one process, first attempt."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0  # torchrun's restarts of the workers so far (elastic, lost process)
    under_torchrun: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    agent_store: bool = False  # torchrun's agent hosts the TCP store (the workers are clients)

    @property
    def first_attempt(self) -> bool:
        """False in workers that torchrun restarted: they continue their own run."""
        return self.restart_count == 0

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> TorchrunEnv:
        def number(name: str, default: int) -> int:
            return int(environ.get(name, default))

        return cls(
            rank=number("RANK", 0),
            local_rank=number("LOCAL_RANK", 0),
            world_size=number("WORLD_SIZE", 1),
            local_world_size=number("LOCAL_WORLD_SIZE", 1),
            restart_count=number("TORCHELASTIC_RESTART_COUNT", 0),
            under_torchrun="TORCHELASTIC_RUN_ID" in environ,
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=number("MASTER_PORT", 29500),
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )


# SIGUSR1: SLURM's --signal warning before a time limit or preemption; stops like SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


PR_SET_PDEATHSIG = 1


# A rank or loader worker made no progress for --hang_timeout and no torchrun restart was left
# (the launcher's watchdog, ``run.watchdog``): the run can resume from its newest checkpoint.
EXIT_HUNG = 3


def exit_code_for(signum: int) -> int:
    """130 after SIGINT, 143 after SIGTERM; a closed terminal (SIGHUP) and SLURM's warning
    (SIGUSR1) are handled as SIGTERM."""
    return 128 + (signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)


def end_children(daemon_only: bool = False) -> None:
    """Kill this process's multiprocessing children (``daemon_only``: its loader workers) and
    wait for them, so that multiprocessing's exit finds none to wait for: loader workers ignore
    its SIGTERM (``data.loaders.quiet_loader_worker``). torch's loader SIGCHLD handler is
    removed first: it would raise at the first worker killed and leave the others alive."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon or not daemon_only:
            child.kill()
            child.join()


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``signum`` to this process when its parent dies. A no-op elsewhere.

    The request is tied to the parent thread that started this process, and is lost if the parent
    died before it was made: then the process is signalled at once.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # orphaned already (adopted by init)
        os.kill(os.getpid(), signum)


# Set to 1, lets more processes than visible GPUs run, sharing them over gloo (NCCL refuses two
# ranks on one device). Only for the CUDA checks (tests/gpu/), so that the multi-process
# CUDA path runs on one-GPU machines; never faster than one process per GPU, so not a flag.
SHARE_GPUS_ENV = "IMGTRAINER_SHARE_GPUS"


def gpus_may_be_shared() -> bool:
    return os.environ.get(SHARE_GPUS_ENV) == "1"


def cuda_not_visible(advice: str) -> str:
    """The line for --device cuda without a visible CUDA GPU: the launcher finds it without torch,
    a worker with torch (``distributed.setup.choose_device``)."""
    return f"--device cuda was asked for but no CUDA GPU is visible; {advice}"


def visible_gpu_count() -> int:
    """The CUDA GPUs a process started from here would see, without importing torch.

    The NVIDIA driver creates one /dev/nvidiaN node per GPU, and a container gets the nodes of
    the GPUs it was given only; CUDA_VISIBLE_DEVICES then narrows the list (CUDA reads it up to
    the first entry it cannot use; empty or "-1" hides every GPU). This is a count, not a proof
    that CUDA works: each worker still checks its device with torch and, if it has none, stops
    with one line through the launcher.
    """
    installed = sum(1 for name in _dev_entries() if re.fullmatch(r"nvidia\d+", name))
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return installed
    entries = 0
    for item in listed.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        entries += 1
    return min(entries, installed)


def _dev_entries() -> list[str]:
    try:
        return os.listdir("/dev")
    except OSError:
        return []


def return_free_memory() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``; a no-op
    elsewhere). Listing a million images frees many small temporary buffers between the
    compact arrays that stay: without this the process keeps their pages, and every loader
    worker forked from it counts them too."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return


def process_map(function, items: Sequence, workers: int, chunksize: int = 1) -> list:
    """``[function(item) for item in items]`` in ``workers`` forked processes (``ForkedMap``),
    ``chunksize`` items per task."""
    chunks = [items[i : i + chunksize] for i in range(0, len(items), chunksize)]
    forked = ForkedMap(lambda chunk: [function(item) for item in chunk], chunks, workers)
    try:
        done = dict(forked.results())
    finally:
        forked.close()
    return [result for i in range(len(chunks)) for result in done[i]]


class ForkedMap:
    """``function(task)`` for each of ``tasks`` in ``workers`` forked processes, the results
    as they come: ``(index of the task, result)`` from ``results()``, in any one thread.

    Each child has a pipe of its own and asks for its next task there; no lock is shared
    between processes. A child that ends at any moment (the out-of-memory killer, a signal)
    therefore leaves nothing waiting on it: its unfinished task is done by this process
    (``lost`` names it), the others go on. ``multiprocessing.Pool`` waits forever for a lost
    task, and deadlocks on its queue's lock when a child dies waiting for one. ``function`` and
    the tasks are inherited by the fork, never pickled (a bound method would carry its whole
    object, e.g. a table of a million images); only the results travel.

    The children take the default signal actions: a training process's stop handlers,
    inherited, would keep them alive. The stop signals stay blocked across the fork until a
    child has reset them, so one that arrives meanwhile ends the child rather than run the
    parent's handler. They die with the thread that made this object, however it ends.
    ``background``: they run only on CPU time that nothing else wants (Linux's SCHED_IDLE;
    else the lowest nice level), as a check that runs beside training should. ``start``:
    called in each child with its number (0, 1, ...), after that."""

    def __init__(
        self,
        function: Callable,
        tasks: Sequence,
        workers: int,
        background: bool = False,
        start: Callable[[int], None] | None = None,
    ):
        self.function, self.tasks = function, tasks
        self.lost: list[tuple[int, int | None]] = []  # (pid, exit code) of children lost
        self.closed, self.iterating = False, False
        self.children: dict = {}  # this process's end of a child's pipe -> the child
        self.lock = threading.Lock()  # close() may come from another thread than results()
        context = multiprocessing.get_context("fork")
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for number in range(min(max(1, workers), len(tasks))):
                mine, theirs = context.Pipe()
                begin = functools.partial(
                    _child_start, background, start and functools.partial(start, number)
                )
                child = context.Process(
                    target=_serve, args=(function, tasks, theirs, mine, begin), daemon=True
                )
                try:
                    child.start()
                except BaseException:
                    mine.close()
                    raise
                finally:
                    theirs.close()  # only the child holds it: its end reads as closed here
                self.children[mine] = child
        except BaseException:  # a fork refused (no memory): none of the others is left behind
            self.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def results(self) -> Iterator[tuple[int, object]]:
        """``(index, function(tasks[index]))`` for every task, in the order they finish; an
        error raised by ``function`` in a child is raised here, with the child's traceback as
        its cause. Stops early once closed."""
        with self.lock:
            self.iterating = True
        try:
            yield from self._results()
        finally:
            with self.lock:
                self.iterating = False
                if self.closed:  # close() left the pipes to this thread, which may wait on them
                    self._close_pipes()

    def _results(self) -> Iterator[tuple[int, object]]:
        waiting = collections.deque(range(len(self.tasks)))
        busy: dict = {}  # a child's pipe -> the index of the task it has
        for conn in list(self.children):
            self._give(conn, waiting, busy)
        while busy and not self.closed:
            for conn in multiprocessing.connection.wait(list(busy)):
                try:
                    index, error, result = conn.recv()
                except (EOFError, OSError):  # the child ended before its result
                    if self.closed:
                        return
                    index = busy.pop(conn)
                    self._lose(conn)
                    yield index, self.function(self.tasks[index])
                    continue
                except Exception as err:  # e.g. an error that pickles but does not unpickle
                    raise RuntimeError(f"a forked process's answer is unreadable: {err}") from err
                if error is not None:
                    raise error
                self._give(conn, waiting, busy)
                yield index, result
        while waiting and not self.closed:  # every child was lost
            index = waiting.popleft()
            yield index, self.function(self.tasks[index])

    def _give(self, conn, waiting: collections.deque, busy: dict) -> None:
        """The child's next task, or the end of its work."""
        busy.pop(conn, None)
        try:
            if waiting:
                conn.send(waiting[0])
                busy[conn] = waiting.popleft()
            else:
                conn.send(None)
        except OSError:  # ended since its last result: its task goes to another
            self._lose(conn)

    def _lose(self, conn) -> None:
        with self.lock:
            if self.closed or conn not in self.children:  # closed meanwhile: close() ends it
                return
            child = self.children.pop(conn)
            conn.close()
        child.join(5)
        self.lost.append((child.pid, child.exitcode))

    def close(self) -> None:
        """End the children now (their work may be unfinished) and wait for them. Safe from
        any thread, more than once."""
        with self.lock:
            self.closed = True
            children = list(self.children.values())
            for child in children:
                if child.is_alive():
                    child.kill()
            if not self.iterating:
                self._close_pipes()
        for child in children:
            child.join()

    def _close_pipes(self) -> None:
        while self.children:
            self.children.popitem()[0].close()


def _serve(function, tasks, conn, parent_end, begin: Callable[[], None]) -> None:
    """A child of ``ForkedMap``: the tasks it is given, until it is told the work is done."""
    parent_end.close()
    begin()
    while (index := conn.recv()) is not None:
        try:
            reply = (index, None, function(tasks[index]))
        except Exception as err:  # raised in the parent, with this traceback as its cause
            reply = (
                index,
                multiprocessing.pool.ExceptionWithTraceback(err, err.__traceback__),
                None,
            )
        try:
            conn.send(reply)
        except Exception as err:  # an error or a result that does not pickle
            conn.send((index, RuntimeError(f"{type(err).__name__}: {err}"), None))


def _child_start(background: bool, start: Callable[[], None] | None = None) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with_parent(signal.SIGKILL)
    if background:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            os.nice(19)
    if start is not None:
        start()

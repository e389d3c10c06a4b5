"""Process helpers below every layer, without torch (the launcher imports them).

What torchrun tells a worker through its environment (read once), the signals that stop a run
and their exit codes, the parent-death signal that ends a chain of processes together, pools of
forked processes, and the GPUs a process started from here would see.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.pool
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
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
    """``[function(item) for item in items]`` in ``workers`` forked processes
    (``forked_pool``)."""
    global _FUNCTION
    _FUNCTION = function  # inherited by the forked children: never pickled (a bound method
    # would carry its whole object, e.g. a table of a million images, with every chunk)
    pool = forked_pool(workers)
    try:
        results = pool.map(_call, items, chunksize=chunksize)
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    finally:
        _FUNCTION = None
    pool.close()  # the children leave on their own once the queue is empty
    pool.join()
    return results


def forked_pool(
    workers: int, background: bool = False, start: Callable[[], None] | None = None
) -> multiprocessing.pool.Pool:
    """A pool of ``workers`` forked processes that take the default signal actions: a
    training process's stop handlers, inherited, would keep them alive through the pool's
    own SIGTERM. The stop signals stay blocked across the fork until a child has reset them,
    so one that arrives meanwhile ends the child rather than run the parent's handler (which
    would leave a start waiting forever on a child that outlived the signal). They die
    with this process, however it ends. ``background``: the children run only on CPU time
    that nothing else wants (Linux's SCHED_IDLE; else the lowest nice level), as a check that
    runs beside training should. ``start``: called in each child as it starts, after that."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return multiprocessing.get_context("fork").Pool(
            workers, initializer=_child_start, initargs=(background, start)
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_FUNCTION = None  # process_map's function, in its forked children


def _call(item):
    return _FUNCTION(item)


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

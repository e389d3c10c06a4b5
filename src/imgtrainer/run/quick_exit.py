"""``python src/quick_exit.py [--preload MODULES] MODULE:FUNCTION ARGS...``: call an entry point
the way its console script does (the ``torchrun`` command is ``torch.distributed.run:main``), then
exit without Python's interpreter teardown.

The launcher runs torchrun as ``python src/quick_exit.py torch.distributed.run:main ...``.
torchrun's agent imports torch; once its workers have ended, tearing its interpreter down (atexit
handlers, freeing every module) took 1-2.5 s here between the last line of the run and the
launcher's exit. Everything torchrun does (rendezvous, monitoring, restarts, the exit barrier
between nodes, stopping workers on a signal) runs unchanged; only the teardown after its last
action is skipped. Its exit code and its failure reports (on stderr) are torchrun's.

The function is called directly, as the ``torchrun`` command calls it, not through ``runpy`` as
``python -m`` would: torch's rendezvous names each of its events with ``inspect.stack()``, and a
``<frozen runpy>`` frame on the stack makes every such call scan all loaded modules. With the
trainer preloaded that cost seconds at each start and end.

``--preload imgtrainer.run.train`` first imports those modules (comma-separated) in the agent. With
torchrun's ``--start-method fork --run-path``, the workers are forks of the agent and find torch,
torchvision, timm and the trainer's modules imported already: each worker's start no longer pays
a second import of them (seconds each on a small machine). Importing runs no torch operation, so
no OpenMP thread pool and no CUDA context exists in the agent when it forks.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

USAGE = "usage: python src/quick_exit.py [--preload MODULES] MODULE:FUNCTION [ARGS...]"


def preload(modules: str) -> None:
    """Import ``modules`` (comma-separated) here, for the workers forked from this process."""
    for name in filter(None, modules.split(",")):
        importlib.import_module(name)
    from imgtrainer.run.lifecycle import mark

    mark("agent imports done", who="agent")


def run_entry_point(argv: list[str]) -> int:
    """Call ``MODULE:FUNCTION`` with ``sys.argv`` = [MODULE, *ARGS]; return its exit code."""
    if len(argv) >= 2 and argv[0] == "--preload":
        preload(argv[1])
        argv = argv[2:]
    if not argv or argv[0].count(":") != 1:
        print(USAGE, file=sys.stderr)
        return 2
    module, function = argv[0].split(":")
    sys.argv = [module, *argv[1:]]
    try:
        result = getattr(importlib.import_module(module), function)()
    except SystemExit as end:
        result = end.code
    except BaseException:  # what Python would print for an uncaught exception, then exit 1
        traceback.print_exc()
        return 1
    return result if isinstance(result, int) else (0 if result is None else 1)


def exit_quickly(code: int) -> None:
    """Flush the streams and exit with ``code``, skipping the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

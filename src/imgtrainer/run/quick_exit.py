"""Call an entry point as its console script does, then exit without interpreter teardown.

``python src/quick_exit.py [--preload MODULES] MODULE:FUNCTION ARGS...`` (the ``torchrun``
command is ``torch.distributed.run:main``). The launcher runs torchrun's agent through it, with
``--preload imgtrainer.run.train`` so that workers forked from the agent find the trainer
imported (docs/development.md: the processes of a run).
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
    except BaseException as error:  # what Python would print for an uncaught exception, exit 1
        traceback.print_exc()
        from imgtrainer.run.lifecycle import write_agent_failure

        write_agent_failure(error)  # for the launcher, when this is torchrun's agent
        return 1
    return result if isinstance(result, int) else (0 if result is None else 1)


def exit_quickly(code: int) -> None:
    """Flush the streams and exit with ``code``, skipping the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

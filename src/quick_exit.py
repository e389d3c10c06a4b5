"""``python src/quick_exit.py -m MODULE ARGS...``: run a module like ``python -m MODULE ARGS...``,
then exit without Python's interpreter teardown.

The launcher runs torchrun as ``python src/quick_exit.py -m torch.distributed.run ...``. torchrun's
agent imports torch; once its workers have ended, tearing its interpreter down (atexit handlers,
freeing every module) took 1-2.5 s here between the last line of the run and the launcher's exit.
Everything torchrun does (rendezvous, monitoring, restarts, the exit barrier between nodes,
stopping workers on a signal) runs unchanged; only the teardown after its last action is skipped.
Its exit code and its failure reports (on stderr) are torchrun's.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def run_module(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "-m":
        print("usage: python src/quick_exit.py -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    module = argv[1]
    sys.argv = [module, *argv[2:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException:  # what Python would print for an uncaught exception, then exit 1
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = run_module(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

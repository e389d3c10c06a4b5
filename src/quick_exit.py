"""``python src/quick_exit.py [--preload MODULES] MODULE:FUNCTION ARGS...``: call an entry point
the way its console script does, then exit without Python's interpreter teardown.

A thin script over ``imgtrainer.run.quick_exit``; the launcher runs torchrun through it.
"""

import sys

from imgtrainer.run.quick_exit import exit_quickly, run_entry_point

if __name__ == "__main__":
    exit_quickly(run_entry_point(sys.argv[1:]))

"""Evaluate a checkpoint on an ImageFolder and write a report of where the model fails.

    python src/evaluate.py --checkpoint checkpoints/checkpoint_best.pth --data_dir data/val --output logs/eval --report

A thin script over ``imgtrainer.tools.evaluate`` (this folder is on ``sys.path`` when it runs).
"""

import gc
import sys

from imgtrainer.tools.evaluate import main

if __name__ == "__main__":
    code = main()
    gc.freeze()  # the interpreter's teardown skips its collector's passes (a second, with torch)
    sys.exit(code)

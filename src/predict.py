"""Top-k predictions of a trained checkpoint for image files and folders.

    python src/predict.py --checkpoint checkpoints/checkpoint_best.pth photos/ --topk 3

A thin script over ``imgtrainer.tools.predict`` (this folder is on ``sys.path`` when it runs).
"""

import gc
import sys

from imgtrainer.tools.predict import main

if __name__ == "__main__":
    code = main()
    gc.freeze()  # the interpreter's teardown skips its collector's passes (a second, with torch)
    sys.exit(code)

"""Top-k predictions of a trained checkpoint for image files and folders.

    python src/predict.py --checkpoint checkpoints/checkpoint_best.pth photos/ --topk 3

A thin script over ``imgtrainer.tools.predict`` (this folder is on ``sys.path`` when it runs).
"""

import sys

from imgtrainer.tools.predict import main

if __name__ == "__main__":
    sys.exit(main())

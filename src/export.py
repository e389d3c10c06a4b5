"""Export a checkpoint to ONNX, TorchScript or safetensors, with its preprocessing beside it,
and check the exported model against the checkpoint.

    python src/export.py --checkpoint checkpoints/checkpoint_best.pth --format onnx

A thin script over ``imgtrainer.tools.export`` (this folder is on ``sys.path`` when it runs).
"""

import gc
import sys

from imgtrainer.tools.export import main

if __name__ == "__main__":
    code = main()
    gc.freeze()  # the interpreter's teardown skips its collector's passes (a second, with torch)
    sys.exit(code)

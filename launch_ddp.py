#!/usr/bin/env python
"""Launch src/train_ddp.py under torchrun on 1..N GPUs (or CPU processes), on one or more nodes.

    python launch_ddp.py --demo                              # the bundled demo data
    python launch_ddp.py --num_gpus 2 --use_amp              # 2 GPUs, DDP + AMP
    python launch_ddp.py --device cpu --nproc 2              # 2 CPU processes over gloo
    python launch_ddp.py --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 ...

A thin script over ``imgtrainer.run.launcher``, which never imports torch.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))

from imgtrainer.run.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

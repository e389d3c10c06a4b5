"""Train an image classifier with DistributedDataParallel on images in any data layout.

    python launch_ddp.py --num_gpus 2 --use_amp
    torchrun --nproc_per_node=2 src/train_ddp.py --use_amp
    python src/train_ddp.py --train_dir data/train --val_dir data/val --use_amp
    python src/train_ddp.py --demo --device cpu

A thin script over ``imgtrainer.run.train`` (this folder is on ``sys.path`` when it runs).
"""

from imgtrainer.run.train import run_as_script

if __name__ == "__main__":
    run_as_script()

#!/usr/bin/env bash
# The fine-tuning recipe, measured offline: no ImageNet weights can be downloaded here, so the
# "pretrained" model is trained on half of the photo set's classes, and bench/recipes/recipes.py then
# fine-tunes it on the other half (--pretrained_path: its head is replaced), next to training
# from scratch on that half, over several seeds.
#
#   bench/recipes/finetune.sh PHOTOS WORK [recipes.py flags, e.g. --seeds 1,2,3 --epochs 10]
#   PRETRAIN_EPOCHS=40 (default) sets the pretraining's length; LAUNCH_FLAGS adds launcher flags
#   to it (e.g. LAUNCH_FLAGS="--device cpu").
#
# PHOTOS is bench/recipes/natural_data.py's folder (train/ and val/); the halves are copied into WORK.
set -euo pipefail
photos=$1 work=$2
shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)

python - "$photos" "$work" <<'EOF'
import shutil
import sys
from pathlib import Path

photos, work = map(Path, sys.argv[1:])
classes = sorted(p.name for p in (photos / "train").iterdir() if p.is_dir())
half = len(classes) // 2
for part, names in (("pretrain", classes[:half]), ("finetune", classes[half:])):
    for split in ("train", "val"):
        for name in names:
            if not (work / part / split / name).exists():
                shutil.copytree(photos / split / name, work / part / split / name)
print(f"{half} classes to pretrain on, {len(classes) - half} to fine-tune on, in {work}")
EOF

# The from-scratch recipe of the README (learning rate 0.004, label smoothing 0.1).
# shellcheck disable=SC2086  # LAUNCH_FLAGS is a list of flags
python "$root/launch_ddp.py" --train_dir "$work/pretrain/train" --val_dir "$work/pretrain/val" \
    --image_size 64 --epochs "${PRETRAIN_EPOCHS:-40}" --learning_rate 0.004 \
    --label_smoothing 0.1 --checkpoint_dir "$work/pretrained/checkpoints" \
    --log_dir "$work/pretrained/logs" --overwrite --no_tensorboard --log_interval 50 \
    ${LAUNCH_FLAGS:-}

python "$root/bench/recipes/recipes.py" --data "$work/finetune" --work "$work/runs" \
    --pretrained_path "$work/pretrained/checkpoints/checkpoint_best.pth" \
    --only "defaults,lr 0.004 + label smoothing,fine-tune plain,fine-tune recipe,fine-tune recipe + label smoothing,fine-tune recipe - freeze,fine-tune recipe - head lr,fine-tune recipe + lr 0.001" \
    "$@"

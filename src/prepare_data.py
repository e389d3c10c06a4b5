"""Split a folder of class folders into train/val ImageFolders, stratified per class.

    python src/prepare_data.py --source ~/Downloads/animals --output data --val_ratio 0.2

A thin script over ``imgtrainer.tools.prepare_data`` (this folder is on ``sys.path`` when it runs).
"""

import sys

from imgtrainer.tools.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())

"""Plot a run's curves from its history file, or write its report page.

    python src/utils.py --history logs/training_history.json --output curves.png
    python src/utils.py --report logs

A thin script over ``imgtrainer.tools.plot`` (this folder is on ``sys.path`` when it runs).
"""

import sys

from imgtrainer.tools.plot import main

if __name__ == "__main__":
    sys.exit(main())

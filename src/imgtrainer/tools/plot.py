"""Plot the curves of a run from its history file (no torch needed, no display needed).

python src/utils.py --history logs/training_history.json --output curves.png
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from imgtrainer.errors import exit_on_user_error
from imgtrainer.reports.curves import load_history, plot_curves


@exit_on_user_error
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss, accuracy and learning-rate curves.")
    parser.add_argument("--history", type=Path, default=Path("logs/training_history.json"))
    parser.add_argument("--output", type=Path, default=Path("curves.png"))
    args = parser.parse_args(argv)
    plot_curves(load_history(args.history), args.output)
    print(f"Wrote {args.output}")
    return 0

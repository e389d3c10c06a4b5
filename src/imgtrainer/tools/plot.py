"""Plot the curves of a run from its history file, or write its report page (no torch needed,
no display needed).

python src/utils.py --history logs/training_history.json --output curves.png
python src/utils.py --report logs
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from imgtrainer.errors import UserError, exit_on_user_error
from imgtrainer.reports.page.curves import load_history, plot_curves
from imgtrainer.reports.page.run_report import report_line, write_run_report


@exit_on_user_error
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Plot loss, accuracy and learning-rate curves, or write a run's report page."
    )
    parser.add_argument("--history", type=Path, default=Path("logs/training_history.json"))
    parser.add_argument(
        "--report",
        type=Path,
        metavar="LOG_DIR",
        help="write the run's report page from the files in LOG_DIR (--log_dir of the run; "
        "also while it runs) to LOG_DIR/report.html, or to --output",
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="default: curves.png, or LOG_DIR/report.html"
    )
    args = parser.parse_args(argv)
    if args.report is not None:
        if not args.report.is_dir():
            raise UserError(f"--report {args.report} is not a folder; give a run's --log_dir")
        print(report_line(*write_run_report(args.report, args.output)))
        return 0
    output = args.output or Path("curves.png")
    plot_curves(load_history(args.history), output)
    print(f"Wrote {output}")
    return 0

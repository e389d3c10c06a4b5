"""Figures written to files: matplotlib on its file-only backend, each figure saved and closed.

matplotlib is imported when a figure is drawn, never at import time: the tools that never draw
do not pay for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend: files only, works without a display."""
    import matplotlib

    matplotlib.use("Agg")
    # Class names and paths are drawn as written: "$...$" in a folder name is not TeX.
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def new_figure(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """``plt.subplots(nrows, ncols, **kwargs)`` on the Agg backend: the figure and its axes."""
    return pyplot().subplots(nrows, ncols, **kwargs)


def save_figure(fig: Any, output: Path, dpi: int) -> None:
    """Lay ``fig`` out, write it to ``output`` (its folder made if needed) and close it."""
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=dpi)
    pyplot().close(fig)

"""``<log_dir>/metrics.csv``: one row per epoch record of training_history.json.

Written with it (``reports.history.HistoryWriter``), so a resume drops the same rows the
history drops.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from imgtrainer.files import csv_text

METRICS_CSV = "metrics.csv"


def metrics_csv(records: list[dict[str, Any]]) -> str:
    """The records as CSV: a column per key in the order keys first appear, blank where a
    record lacks one; "" without records."""
    columns: dict[str, None] = {}
    for record in records:
        columns.update(dict.fromkeys(record))
    if not columns:
        return ""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(map(csv_text, columns))
    for record in records:
        writer.writerow(_cell(record.get(column)) for column in columns)
    return out.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return csv_text(json.dumps(value))
    if isinstance(value, str):
        return csv_text(value)
    return str(value)  # a float's shortest exact form

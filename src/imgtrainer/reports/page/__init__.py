"""The report pages: a run's report.html, a checkpoint's evaluation.

Each is one self-contained HTML file with inline charts and pictures."""

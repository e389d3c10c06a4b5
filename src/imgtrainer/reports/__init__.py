"""What a run reports: its history, curves, report pages, confusion matrices, TensorBoard and trackers."""

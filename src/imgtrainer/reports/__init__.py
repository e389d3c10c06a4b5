"""What a run reports: its history, curves, confusion matrices, TensorBoard and trackers."""

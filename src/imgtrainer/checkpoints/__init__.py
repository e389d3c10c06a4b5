"""Checkpoints: crash-safe files, what they hold of a run, resuming from them."""

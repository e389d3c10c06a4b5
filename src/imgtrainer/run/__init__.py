"""The entry points: the launcher, the trainer, and what they need to start and stop."""

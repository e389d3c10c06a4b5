"""The training loop's hook points."""

from __future__ import annotations

from collections.abc import Iterable

from imgtrainer.training.step import StepInfo


class StepHook:
    """Per-step work hangs off three points of the loop. Every method is optional (the loop
    looks each one up), so any object with some of them is a hook; this class documents them.
    A hook that has no job on this rank is built disabled and does nothing.
    """

    def on_step_end(self, info: StepInfo) -> bool:
        """After every loaded batch's optimizer step (``info.taken``: not skipped by the
        GradScaler). True stops the epoch there (a preemption signal)."""
        return False

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        """Every ``log_interval`` steps, with the running train_loss, train_acc and lr already
        read as Python floats (one host synchronisation for all hooks)."""

    def on_epoch_end(self, epoch: int, record: dict) -> None:
        """After an epoch's evaluation, with its history record (called by the trainer)."""


def call_hooks(hooks: Iterable, name: str, *args) -> list:
    """Call ``name`` on each hook that has it; returns their results."""
    return [getattr(hook, name)(*args) for hook in hooks if hasattr(hook, name)]

"""The training loop's hook points (``Hook``) and the ordered list that calls them (``Hooks``).

A hook subclasses ``Hook`` and overrides the points it needs; registering a hook with any other
public ``on_*`` method (a misspelt one) raises, so no hook is silently never called. Instruments
from outside the product (tests, benchmarks) are named in $IMGTRAINER_HOOKS (``declared_hooks``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from imgtrainer.errors import UserError

# "module:factory,...": each factory(trainer) returns a Hook, or None where it has no job.
HOOKS_ENV = "IMGTRAINER_HOOKS"


@dataclass
class StepInfo:
    """What the ``on_step_end`` hooks see after each loaded batch's optimizer step."""

    step: int  # optimizer steps done in this epoch, this one included
    global_step: int  # since the start of the run
    sums: torch.Tensor  # this rank's running [loss_sum, correct, count] of the epoch
    _skipped: torch.Tensor | None = None  # on the device: the GradScaler skipped the step
    # Reports the logging step still pending (``on_log_step`` is one logging step late): a
    # checkpoint calls it first, so a crash after it loses no logged step it covers.
    flush_logs: Callable[[], None] = lambda: None

    @property
    def taken(self) -> bool:
        """False when the GradScaler skipped the step (float16 overflow). Reading it waits for
        the device (a host synchronisation every step): a hook should use ``_skipped`` on the
        device instead, as the EMA does."""
        return self._skipped is None or not bool(self._skipped.item())


class Hook:
    """Per-step work at named points of the loop. A hook that has no job on this rank is built
    with ``enabled`` False (or simply does nothing)."""

    enabled: bool = True
    # For a declared hook (``declared_hooks``): run after the step's EMA update and position,
    # before its checkpoint; else after the run's own hooks.
    before_checkpoint: bool = False

    def on_step_end(self, info: StepInfo) -> bool:
        """After every loaded batch's optimizer step. True stops the epoch there."""
        return False

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        """Every ``log_interval`` steps, with train_loss, train_acc, lr, images_per_sec and
        data_wait_share as Python floats. They are that step's, but reported one logging step
        later (or at the epoch's end): the loop copies them from the device without waiting."""

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> None:
        """After an epoch's evaluation and checkpoint: the epoch number (1-based) and its
        history record."""

    def on_run_end(self, hparams: dict[str, Any], final_metrics: dict[str, Any]) -> None:
        """Once, when the run finished all its epochs: its config and last history record."""

    def close(self) -> None:
        """At the end of the run, whatever happened (flush files)."""


HOOK_POINTS = frozenset(
    name for name in vars(Hook) if name.startswith("on_") and callable(getattr(Hook, name))
)


def declared_hooks(context: Any) -> list[Hook]:
    """The hooks $IMGTRAINER_HOOKS names, in its order, each made by its factory from
    ``context`` (the trainer): the declared seam for test and benchmark instruments."""
    hooks = []
    for entry in filter(None, (e.strip() for e in os.environ.get(HOOKS_ENV, "").split(","))):
        module, _, name = entry.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise UserError(f"${HOOKS_ENV}: cannot find {entry} ({err})") from None
        hook = factory(context)
        if hook is not None:
            hooks.append(hook)
    return hooks


class Hooks:
    """Hooks in the order they run. ``register`` checks each hook's methods against the hook
    points; ``call`` runs one point on the hooks that implement it."""

    def __init__(self, hooks: Iterable[Hook] = ()):
        self._hooks: list[Hook] = []
        for hook in hooks:
            self.register(hook)

    def register(self, hook: Hook, *, before: type[Hook] | None = None) -> Hook:
        """Add ``hook`` last, or ahead of the first hook of type ``before``."""
        if not isinstance(hook, Hook):
            raise TypeError(f"{type(hook).__name__} is not an imgtrainer.hooks.Hook")
        unknown = sorted(
            name
            for name in dir(type(hook))
            if name.startswith("on_") and callable(getattr(hook, name)) and name not in HOOK_POINTS
        )
        if unknown:
            raise TypeError(
                f"{type(hook).__name__}.{unknown[0]} is not a hook point "
                f"(hook points: {', '.join(sorted(HOOK_POINTS))})"
            )
        index = next(
            (i for i, h in enumerate(self._hooks) if before and isinstance(h, before)),
            len(self._hooks),
        )
        self._hooks.insert(index, hook)
        return hook

    def implementing(self, name: str) -> Hooks:
        """The enabled hooks that override ``name`` (e.g. those that want the logging step)."""
        selected = Hooks()
        selected._hooks = [
            h
            for h in self._hooks
            if h.enabled and getattr(type(h), name) is not getattr(Hook, name)
        ]
        return selected

    def call(self, name: str, *args: Any) -> list:
        """Call hook point ``name`` on every hook that overrides it, in order; their results."""
        if name not in HOOK_POINTS and name != "close":
            raise ValueError(f"{name} is not a hook point")
        return [
            getattr(h, name)(*args)
            for h in self._hooks
            if getattr(type(h), name) is not getattr(Hook, name)
        ]

    def __iter__(self) -> Iterator[Hook]:
        return iter(self._hooks)

    def __len__(self) -> int:
        return len(self._hooks)

    def __add__(self, other: Iterable[Hook]) -> Hooks:
        return Hooks([*self._hooks, *other])

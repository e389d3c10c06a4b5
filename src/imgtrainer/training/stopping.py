"""Stopping on a signal or at --max_time, at a step that every rank agrees on.

SIGTERM/SIGINT/SIGHUP/SIGUSR1 (preemption, Ctrl-C, a closed terminal, SLURM's ``--signal``
warning) or a ``TimeBudget`` that runs out sets a flag; the ranks agree on it with a small
all-gather (the flags, and each rank's clocks for ``stragglers``) every ``AGREE_EVERY`` steps and
after an epoch's last step (one process: after every step, no collective), save a checkpoint
together and leave the loop. A second signal, later than one Ctrl-C's burst, exits at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from imgtrainer.distributed.collectives import all_gather_rows, host_group
from imgtrainer.process import STOP_SIGNALS, exit_code_for
from imgtrainer.training.stragglers import StragglerWatch

log = logging.getLogger(__name__)


# One request can reach a rank twice: a signal sent to every process of a job (SLURM, Kubernetes)
# arrives directly and again from torchrun's agent, which passes on what it receives.
SAME_REQUEST_SECONDS = 2.0


# Under torch.distributed, the steps between two agreements on a stop: a host collective every
# step holds the ranks' main threads in lockstep; a stop comes at most this many steps later.
AGREE_EVERY = 10


# The values of the agreed flag: the highest any rank raised wins.
NO_STOP, TIME_STOP, SIGNAL_STOP = 0, 1, 2


class StopRequest:
    def __init__(self, distributed: bool, stragglers: StragglerWatch | None = None):
        self.distributed = distributed
        # Each rank's clocks travel with the flag (``stragglers``): no collective of their own.
        self.stragglers = stragglers
        # The flag travels on the host (gloo), so asking every step never waits for the GPU.
        self.group = host_group() if distributed else None
        self.signum: int | None = None
        self.received_at = 0.0
        self.requested_by_all = False
        self.agreed_flag = NO_STOP
        self.save_agreed = False  # the last agreement's: a checkpoint is due by time
        self.owner_pid = os.getpid()
        self.training = False

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self.owner_pid:
            # A forked loader worker inherited this handler: its parent decides when it stops.
            return
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.received_at = signum, now
            log.warning(
                f"Received {signal.Signals(signum).name}: "
                + (
                    "saving a checkpoint at the next step the processes agree on and stopping"
                    if self.training
                    else "training has ended; writing the run's last files, then exiting"
                )
                + " (send it again to exit at once)"
            )
        elif now - self.received_at > SAME_REQUEST_SECONDS:
            log.warning(f"Received {signal.Signals(signum).name} again: exiting now")
            os._exit(exit_code_for(signum))

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        self.owner_pid = os.getpid()
        previous = self._install()
        self.training = True
        try:
            yield self
        finally:
            self.training = False
            for s, handler in previous.items():
                signal.signal(s, handler)

    def installed_for_wrap_up(self) -> None:
        """The handlers again, once training has ended, for the rest of the process: a stop
        signal while the run's last files are written does not cut them short (a finished
        run still ends 0); a second one exits at once."""
        self.owner_pid = os.getpid()
        self._install()

    def _install(self) -> dict:
        """This request's handler for every stop signal; the handlers it replaced."""
        return {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def agrees_at(self, step: int, at_epoch_end: bool) -> bool:
        """Whether the ranks agree after this step of the epoch (the same steps on every rank)."""
        return not self.distributed or at_epoch_end or step % AGREE_EVERY == 0

    def steps_to_next_agreement(self, step: int, steps_per_epoch: int) -> int:
        """The steps from after ``step`` until the next agreement, its step included."""
        if not self.distributed:
            return 1
        return min(AGREE_EVERY - step % AGREE_EVERY, max(steps_per_epoch - step, 1))

    def agreed(self, time_up: bool = False, save_due: bool = False) -> bool:
        """True on every rank once any rank was signalled or found its ``time_up``. Every rank
        must call it, at the same steps. ``save_due`` (a checkpoint is due by time on this
        rank) travels with it: ``save_agreed`` is then True on every rank."""
        flag = SIGNAL_STOP if self.signum is not None else TIME_STOP if time_up else NO_STOP
        self.save_agreed = save_due
        if self.distributed:
            figures = self.stragglers.clock.take() if self.stragglers else []
            row = torch.tensor([flag, save_due, *figures], dtype=torch.float64)
            rows = all_gather_rows(row, group=self.group)
            flag = int(rows[:, 0].max().item())
            self.save_agreed = bool(rows[:, 1].max().item())
            if self.stragglers:
                self.stragglers.update(rows[:, 2:].tolist())
        if flag == TIME_STOP and self.agreed_flag == NO_STOP:
            log.warning("The --max_time budget is nearly spent: saving a checkpoint and stopping")
        self.agreed_flag = max(self.agreed_flag, flag)
        self.requested_by_all = self.agreed_flag != NO_STOP
        return self.requested_by_all

    @property
    def by_time(self) -> bool:
        """The agreed stop is the --max_time budget's (no rank was signalled)."""
        return self.agreed_flag == TIME_STOP

    @property
    def exit_code(self) -> int:
        """0 for the --max_time budget (as Lightning's max_time and Ultralytics' time end a
        fit), else the signal's 130 or 143."""
        if self.by_time:
            return 0
        return exit_code_for(self.signum or signal.SIGTERM)


# How long a checkpoint takes before one was timed: generous, so the first one fits.
FIRST_SAVE_SECONDS = 5.0


# The estimates of what is ahead are multiplied by this, for the jitter of step times.
SAFETY_FACTOR = 1.25


# Steps whose durations make the step estimate (the longest of them).
STEP_WINDOW = 20


class TimeBudget:
    """--max_time: the seconds this process may train, counted from its creation, and the
    durations timed so far (steps, validations, checkpoints) that say whether the next piece of
    work and a checkpoint still fit. Without a budget it never runs out."""

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.started = clock()
        self.steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self.step_started: float | None = None
        self.save_seconds = FIRST_SAVE_SECONDS
        self.validation_seconds: float | None = None

    @property
    def enabled(self) -> bool:
        return self.seconds is not None

    def remaining(self) -> float:
        return float("inf") if self.seconds is None else self.started + self.seconds - self.clock()

    def start_steps(self) -> None:
        """The next step starts now (an epoch's loader starts): time spent before is no step's."""
        self.step_started = self.clock()

    def step_done(self) -> None:
        now = self.clock()
        if self.step_started is not None:
            self.steps.append(now - self.step_started)
        self.step_started = now

    def timed_save(self, seconds: float) -> None:
        self.save_seconds = seconds

    def timed_validation(self, seconds: float) -> None:
        self.validation_seconds = seconds

    def step_estimate(self) -> float:
        return max(self.steps, default=0.0)

    def validation_estimate(self, batches: int) -> float:
        """The last validation's time; before one, ``batches`` steps' (a validation batch
        costs less than a training step)."""
        if self.validation_seconds is not None:
            return self.validation_seconds
        return self.step_estimate() * batches

    def too_short_for(self, work_seconds: float) -> bool:
        """Whether ``work_seconds`` of work and then a checkpoint no longer fit."""
        return self.remaining() < SAFETY_FACTOR * (work_seconds + self.save_seconds)

    def too_short_for_next_stop(
        self, at_epoch_end: bool, validation_batches: int | None, steps_ahead: int = 1
    ) -> bool:
        """Whether the work up to the next point to stop at, and a checkpoint, no longer fit:
        after an epoch's last step its validation (of ``validation_batches``; None: the epoch
        is not validated), else the next ``steps_ahead`` steps (to the ranks' next agreement)."""
        if not self.enabled:
            return False
        if not at_epoch_end:
            return self.too_short_for(self.step_estimate() * steps_ahead)
        validating = validation_batches is not None
        validation = self.validation_estimate(validation_batches) if validating else 0.0
        return self.too_short_for(validation)

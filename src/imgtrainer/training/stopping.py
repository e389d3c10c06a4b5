"""Stopping on SIGTERM/SIGINT/SIGHUP/SIGUSR1 (preemption, Ctrl-C, a closed terminal, SLURM's
``--signal`` warning before a time limit) at a step that every rank agrees on.

A signal only sets a flag. After each optimizer step every rank calls ``agreed()``, a one-number
all-reduce (MAX) of the flags, so all ranks see the request at the same step even when only one of
them was signalled; they then save a checkpoint together and leave the loop. A second signal,
later than the burst a single Ctrl-C produces (the terminal and torchrun both deliver it), exits
at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator

import torch

from imgtrainer.distributed.collectives import all_reduce_max, host_group
from imgtrainer.run.lifecycle import STOP_SIGNALS, exit_code_for

log = logging.getLogger(__name__)


SIGNALS = STOP_SIGNALS


# One request can reach a rank twice: a signal sent to every process of a job (SLURM, Kubernetes)
# arrives directly and again from torchrun's agent, which passes on what it receives.
SAME_REQUEST_SECONDS = 2.0


class StopRequest:
    def __init__(self, distributed: bool):
        self.distributed = distributed
        # The flag travels on the host (gloo), so asking every step never waits for the GPU.
        self.group = host_group() if distributed else None
        self.signum: int | None = None
        self.received_at = 0.0
        self.requested_by_all = False
        self.owner_pid = os.getpid()

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self.owner_pid:
            # A forked loader worker inherited this handler: its parent decides when it stops.
            return
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.received_at = signum, now
            log.warning(
                f"Received {signal.Signals(signum).name}: saving a checkpoint at the next "
                "step and stopping (send it again to exit at once)"
            )
        elif now - self.received_at > SAME_REQUEST_SECONDS:
            log.warning(f"Received {signal.Signals(signum).name} again: exiting now")
            os._exit(exit_code_for(signum))

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        self.owner_pid = os.getpid()
        previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled. Every rank must call it, at the same
        steps."""
        if not self.distributed:
            self.requested_by_all = self.signum is not None
            return self.requested_by_all
        flag = torch.tensor([0 if self.signum is None else 1])
        self.requested_by_all = bool(all_reduce_max(flag, group=self.group).item())
        return self.requested_by_all

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.signum or signal.SIGTERM)

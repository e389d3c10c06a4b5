"""A hook for the SLURM tests (tests/test_slurm.py), named in $IMGTRAINER_HOOKS as
``slurm_hold:hold_first_start`` with this folder on PYTHONPATH.

SLURM_TEST_HOLD="STEP:FILE" makes the first start of a SLURM job (``$SLURM_RESTART_COUNT``
unset or 0) wait after optimizer step STEP of its first epoch (after that step's checkpoint, if
any) until a stop signal arrives, at most 5 minutes: the run is still training whenever SLURM's
time-limit warning (sent by a check every 30 s) or the test's preemption comes, on any machine.
On reaching the step it writes FILE, which the test waits for. A requeued start runs freely.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_ENV = "SLURM_TEST_HOLD"
HOLD_LIMIT_S = 300.0


def hold_first_start(trainer):
    """The hold hook on the first start of a SLURM job, None on a requeued one."""
    from imgtrainer.hooks import Hook

    if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
        return None
    step, _, marker = os.environ[HOLD_ENV].partition(":")

    class HoldForStop(Hook):
        def on_step_end(self, info) -> bool:
            if trainer.epoch != 0 or info.step != int(step):
                return False
            Path(marker).write_text(f"{os.getpid()}\n")
            # Polled, so the stop signal ends the wait at once.
            end = time.monotonic() + HOLD_LIMIT_S
            while trainer.stop.signum is None and time.monotonic() < end:
                time.sleep(0.05)
            return False

    return HoldForStop()

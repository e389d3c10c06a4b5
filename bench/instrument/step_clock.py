"""Each optimizer step's end, for bench/remote.py: named in $IMGTRAINER_HOOKS as
``step_clock:step_clock`` with this folder on PYTHONPATH, it appends "time epoch step" to the
file $BENCH_STEP_CLOCK names, one line a step, before the step's checkpoint."""

from __future__ import annotations

import os
import time

CLOCK_ENV = "BENCH_STEP_CLOCK"
HOOKS_ENV = "IMGTRAINER_HOOKS"  # imgtrainer.hooks.HOOKS_ENV


def clock_env(path: os.PathLike | str) -> dict[str, str]:
    """The environment that makes a run of ``src/train_ddp.py`` write its step clock to ``path``."""
    folder = os.path.dirname(os.path.abspath(__file__))
    python_path = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH", "")]))
    return {CLOCK_ENV: str(path), HOOKS_ENV: "step_clock:step_clock", "PYTHONPATH": python_path}


def step_clock(trainer):
    from imgtrainer.hooks import Hook

    path = os.environ[CLOCK_ENV]

    class StepClock(Hook):
        before_checkpoint = True

        def on_step_end(self, info) -> bool:
            with open(path, "a") as clock:
                clock.write(f"{time.time():.6f} {trainer.epoch + 1} {info.step}\n")
            return False

    return StepClock()

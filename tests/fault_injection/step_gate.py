"""A hook for faults placed by training progress (bench/chaos.py, tests/test_elastic.py), named
in $IMGTRAINER_HOOKS as ``step_gate:hold_at_gate`` with this folder on PYTHONPATH.

STEP_GATE=FOLDER: after each optimizer step (and its checkpoint, if any), each rank reads
FOLDER/gate, "STEP ATTEMPT": at the first global step at or after STEP, on a torchrun attempt
at or after ATTEMPT, the rank writes FOLDER/held.rank{R} ("STEP ATTEMPT GLOBAL_STEP" with its
own attempt) and waits until FOLDER/gate changes (the soak, having injected its fault there,
names the next gate) or a stop signal arrives, at most 5 minutes. So the soak's faults come at
the steps it chose, however fast or slow the machine; an attempt that a fault ends trains on
freely past a gate meant for the attempt after it. A rank that is stopping does not wait (its
stop must reach its agreed step and checkpoint).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

GATE_ENV = "STEP_GATE"
HOLD_LIMIT_S = 300.0


def read_gate(path: Path) -> tuple[int, int] | None:
    """(step, first attempt) of FOLDER/gate, or None where there is none."""
    try:
        step, attempt = path.read_text().split()
        return int(step), int(attempt)
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def hold_at_gate(trainer):
    """The gate hook of $STEP_GATE."""
    from imgtrainer import heartbeat
    from imgtrainer.hooks import Hook

    folder = Path(os.environ[GATE_ENV])
    gate_file, held = folder / "gate", folder / f"held.rank{trainer.dist.rank}"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    class StepGate(Hook):
        def on_step_end(self, info) -> bool:
            gate = read_gate(gate_file)
            stopping = trainer.stop.signum is not None
            if gate is None or info.global_step < gate[0] or attempt < gate[1] or stopping:
                return False
            write_atomic(held, f"{gate[0]} {attempt} {info.global_step}")
            end = time.monotonic() + HOLD_LIMIT_S
            while read_gate(gate_file) == gate and trainer.stop.signum is None:
                if time.monotonic() > end:
                    break
                heartbeat.tick()  # held on purpose: not a hang for the launcher's watchdog
                time.sleep(0.02)
            return False

    return StepGate()

"""Each optimizer step's end, for bench/remote.py: named in $IMGTRAINER_HOOKS as
``step_clock:step_clock`` with this folder on PYTHONPATH, it appends "time epoch step cpu" to the
file $BENCH_STEP_CLOCK names, one line a step, before the step's checkpoint (cpu: the seconds of
CPU of the run's processes so far, ``process_cpu``; ``step_clock:loader_clock``: a line per
batch of the training loader read alone).
"""

from __future__ import annotations

import glob
import os
import resource
import time

CLOCK_ENV = "BENCH_STEP_CLOCK"
HOOKS_ENV = "IMGTRAINER_HOOKS"  # imgtrainer.hooks.HOOKS_ENV


def clock_env(path: os.PathLike | str, loader_only: bool = False) -> dict[str, str]:
    """The environment that makes a run of ``src/train_ddp.py`` write its step clock to ``path``
    (``loader_only``: its training loader's batches, read alone; ``loader_clock``)."""
    folder = os.path.dirname(os.path.abspath(__file__))
    python_path = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH", "")]))
    hook = "step_clock:loader_clock" if loader_only else "step_clock:step_clock"
    return {CLOCK_ENV: str(path), HOOKS_ENV: hook, "PYTHONPATH": python_path}


def process_cpu() -> float:
    """CPU seconds of this process, its finished children and its live ones (the loader
    workers, the decode check); read again if a child was reaped between the two counts."""
    while True:
        finished = cpu_seconds(resource.getrusage(resource.RUSAGE_CHILDREN))
        live = 0.0
        for listing in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
            for pid in open(listing).read().split():
                try:  # utime and stime, in clock ticks, after the command's parenthesis
                    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # reaped since the listing: the next count holds it
                live += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if cpu_seconds(resource.getrusage(resource.RUSAGE_CHILDREN)) == finished:
            return cpu_seconds(resource.getrusage(resource.RUSAGE_SELF)) + finished + live


def cpu_seconds(usage: resource.struct_rusage) -> float:
    """The user and system CPU seconds of a ``getrusage`` answer."""
    return usage.ru_utime + usage.ru_stime


def step_clock(trainer):
    from imgtrainer.hooks import Hook

    path = os.environ[CLOCK_ENV]

    class StepClock(Hook):
        before_checkpoint = True

        def on_step_end(self, info) -> bool:
            line = f"{time.time():.6f} {trainer.epoch + 1} {info.step} {process_cpu():.3f}\n"
            with open(path, "a") as clock:
                clock.write(line)
            return False

    return StepClock()


def loader_clock(trainer):
    """The training loader alone (``BENCH_LOADER_ONLY``): its first epoch read to the end on
    the host (no device copy, no model), a clock line per batch, then the process ends."""
    path = os.environ[CLOCK_ENV]
    trainer.loaders.sampler.set_epoch(0)
    started, images = process_cpu(), 0
    with open(path, "a") as clock:
        for step, batch in enumerate(trainer.train_loader.loader, 1):
            images += len(batch[-1])
            clock.write(f"{time.time():.6f} 1 {step}\n")
    with open(f"{path}.cpu", "w") as out:
        out.write(f"{process_cpu() - started:.3f} {images}\n")
    os._exit(0)  # the run's files are not the point: nothing trained, nothing to save

"""Fault injection for the crash-resume tests, loaded at interpreter start-up from PYTHONPATH
(``conftest.kill_at``) by the launcher, torchrun and every worker.

TRAIN_DDP_KILL_AT="EPOCH:STEP[:RANK]" makes that rank (every rank if RANK is left out) SIGKILL
itself right after that optimizer step of that epoch (1-based), on the first torchrun attempt
only, so the restarted workers run on. The kill comes after the EMA update and the position of
that step, before its checkpoint: the trainer's registration gets one more hook, ahead of
``CheckpointAndStop``, once ``imgtrainer.training.trainer`` is imported.

TRAIN_DDP_RECORD_INDICES=DIR makes every rank append, after each optimizer step, the training
indices that step used to DIR/indices.jsonl (``install_recorder``): one JSON line with the run
attempt (its start position, world size and
torchrun restart), epoch, step, rank, world size and indices. The loader reads the sampler lazily with
--num_workers 0, so the keys the sampler gave since the last step are that step's batch.

TRAIN_DDP_STEP_DELAY="SECONDS:WORLD" makes every rank of a run on WORLD processes wait up to
SECONDS after each optimizer step (after its checkpoint), cut short by a stop signal: a run that
is still training when another node joins (``install_delay``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import os
import signal
import sys
import time

KILL_AT_ENV = "TRAIN_DDP_KILL_AT"
RECORD_ENV = "TRAIN_DDP_RECORD_INDICES"
DELAY_ENV = "TRAIN_DDP_STEP_DELAY"
TRAINER_MODULE = "imgtrainer.training.trainer"
# A child of the project logger, so the message reaches the rank's log file.
LOGGER = "imgtrainer.fault_injection"


def kill_point(rank: int) -> tuple[int, int] | None:
    """The (epoch, step) at which this rank must kill itself."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    kill_epoch, kill_step, *kill_rank = (int(part) for part in spec.split(":"))
    return (kill_epoch, kill_step) if not kill_rank or kill_rank[0] == rank else None


def install(trainer_module) -> None:
    """Wrap ``Trainer.register_hooks`` to register a ``FaultInjection`` hook too."""
    from imgtrainer.hooks import Hook

    class FaultInjection(Hook):
        def __init__(self, trainer, point: tuple[int, int]):
            self.trainer, self.point = trainer, point

        def on_step_end(self, info) -> bool:
            epoch, rank = self.trainer.epoch + 1, self.trainer.dist.rank
            if self.point == (epoch, info.step):
                logging.getLogger(LOGGER).warning(
                    f"{KILL_AT_ENV}: killing rank {rank} with SIGKILL at epoch {epoch}, "
                    f"step {info.step}"
                )
                os.kill(os.getpid(), signal.SIGKILL)
            return False

    trainer_class = trainer_module.Trainer
    register_hooks = trainer_class.register_hooks

    def register_hooks_with_fault(self) -> None:
        register_hooks(self)
        point = kill_point(self.dist.rank)
        if point is not None:
            self.hooks.register(
                FaultInjection(self, point), before=trainer_module.CheckpointAndStop
            )

    trainer_class.register_hooks = register_hooks_with_fault


def install_recorder(trainer_module, folder: str) -> None:
    """Wrap ``Trainer.register_hooks`` to record each step's training indices (first hook)."""
    from imgtrainer.hooks import Hook

    class RecordIndices(Hook):
        def __init__(self, trainer):
            self.trainer = trainer
            # The same on every rank of one attempt: where it started, on how many processes.
            self.attempt = (
                f"{trainer.epoch}:{trainer.step}:{trainer.dist.world_size}:"
                f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            )
            self.keys: list[tuple[int, int]] = []
            sampler = trainer.sampler
            base = type(sampler)

            def recording_iter(this):
                for key in base.__iter__(this):
                    self.keys.append(key)
                    yield key

            # The loader holds this sampler: a subclass of its own class records what it gives.
            sampler.__class__ = type(
                "Recording" + base.__name__, (base,), {"__iter__": recording_iter}
            )

        def on_step_end(self, info) -> bool:
            trainer = self.trainer
            record = {
                "attempt": self.attempt,
                "epoch": trainer.epoch,
                "step": info.step,
                "rank": trainer.dist.rank,
                "world_size": trainer.dist.world_size,
                "indices": [index for index, _ in self.keys],
            }
            self.keys.clear()
            with open(os.path.join(folder, "indices.jsonl"), "a") as out:
                out.write(json.dumps(record) + "\n")
            return False

    register_hooks = trainer_module.Trainer.register_hooks

    def register_hooks_with_recorder(self) -> None:
        register_hooks(self)
        self.hooks.register(RecordIndices(self), before=type(self.ema))

    trainer_module.Trainer.register_hooks = register_hooks_with_recorder


def install_delay(trainer_module, spec: str) -> None:
    """Wrap ``Trainer.register_hooks`` to wait after each step at one world size (last hook)."""
    from imgtrainer.hooks import Hook

    seconds, world = float(spec.split(":")[0]), int(spec.split(":")[1])

    class StepDelay(Hook):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_step_end(self, info) -> bool:
            # Polled, so a stop signal (the agent stopping its workers) ends the wait at once.
            end = time.monotonic() + seconds
            while self.trainer.stop.signum is None and time.monotonic() < end:
                time.sleep(0.05)
            return False

    register_hooks = trainer_module.Trainer.register_hooks

    def register_hooks_with_delay(self) -> None:
        register_hooks(self)
        if self.dist.world_size == world:
            self.hooks.register(StepDelay(self))

    trainer_module.Trainer.register_hooks = register_hooks_with_delay


class _AfterTrainerImport(importlib.abc.MetaPathFinder):
    """Finds the trainer module with the usual finders, and installs the hook after it runs."""

    def find_spec(self, name, path, target=None):
        if name != TRAINER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_install(module) -> None:
            exec_module(module)
            if os.environ.get(KILL_AT_ENV):
                install(module)
            if os.environ.get(RECORD_ENV):
                install_recorder(module, os.environ[RECORD_ENV])
            if os.environ.get(DELAY_ENV):
                install_delay(module, os.environ[DELAY_ENV])

        spec.loader.exec_module = exec_and_install
        return spec


if any(os.environ.get(name) for name in (KILL_AT_ENV, RECORD_ENV, DELAY_ENV)):
    sys.meta_path.insert(0, _AfterTrainerImport())

"""How one optimizer step's global batch is made, and the batch arithmetic of a config.

Passes of --batch_size images, --accum_steps of them per process, on the processes of this
start (``Layout``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from imgtrainer.config.schema import TrainConfig
from imgtrainer.errors import UserError
from imgtrainer.process import TorchrunEnv


def with_global_batch_layout(cfg: TrainConfig, given: set[str], env: TorchrunEnv) -> TrainConfig:
    """With --global_batch_size, the --batch_size and --accum_steps that make it at this start's
    world size. Flags typed explicitly are kept; at a fresh start (not a resume, not a restarted
    worker) flags that cannot make it are refused. A resume at another world size lays the run
    out again (``training.trainer``)."""
    if cfg.global_batch_size is None:
        return cfg
    world = env.world_size
    fresh = cfg.resume is None and env.first_attempt
    fixed = {name: getattr(cfg, name) for name in ("batch_size", "accum_steps") if name in given}
    try:
        layout = choose_layout(cfg.global_batch_size, world, cfg.batch_size, fixed)
    except LayoutContradiction as err:
        if fresh:
            raise UserError(str(err)) from None
        layout = choose_layout(cfg.global_batch_size, world, cfg.batch_size)
    return dataclasses.replace(cfg, batch_size=layout.batch_size, accum_steps=layout.accum_steps)


@dataclass(frozen=True)
class Layout:
    """How one optimizer step's global batch is made: passes of ``batch_size`` images,
    ``accum_steps`` of them per process, on ``world_size`` processes."""

    batch_size: int
    accum_steps: int
    world_size: int

    @classmethod
    def of(cls, cfg: TrainConfig, world_size: int) -> Layout:
        """The layout of ``cfg``'s --batch_size and --accum_steps on ``world_size`` processes."""
        return cls(cfg.batch_size, cfg.accum_steps, world_size)

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all processes."""
        return self.batch_size * self.accum_steps * self.world_size

    def describe(self) -> str:
        return (
            f"--batch_size {self.batch_size} x --accum_steps {self.accum_steps} x "
            f"{self.world_size} process(es) = {self.global_batch}"
        )

    def short(self) -> str:
        """``describe`` in a resume's list of changes: "8x2x2=32"."""
        return f"{self.batch_size}x{self.accum_steps}x{self.world_size}={self.global_batch}"


class LayoutContradiction(UserError):
    """Explicit --batch_size/--accum_steps that cannot make --global_batch_size."""


def world_sizes_for(global_batch: int, limit: int = 12) -> str:
    """The numbers of processes that can share ``global_batch`` evenly (its divisors)."""
    sizes = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    return ", ".join(map(str, sizes[:limit])) + (", ..." if len(sizes) > limit else "")


def choose_layout(
    global_batch: int, world_size: int, max_pass: int, fixed: dict[str, int] | None = None
) -> Layout:
    """The layout that makes ``global_batch`` on ``world_size`` processes: the largest pass of
    at most ``max_pass`` images that divides a process's share, and as many accumulation steps
    as it takes; ``fixed`` (explicit flags) must be kept, or LayoutContradiction."""
    if global_batch % world_size:
        raise UserError(
            f"the global batch of {global_batch} images cannot be split evenly over "
            f"{world_size} processes; numbers of processes that can: "
            f"{world_sizes_for(global_batch)} (or resume with another --global_batch_size "
            "and --resume_override)"
        )
    share = global_batch // world_size
    fixed = fixed or {}
    if "accum_steps" in fixed and "batch_size" not in fixed and share % fixed["accum_steps"] == 0:
        return Layout(share // fixed["accum_steps"], fixed["accum_steps"], world_size)
    if "batch_size" in fixed and share % fixed["batch_size"] == 0:
        layout = Layout(fixed["batch_size"], share // fixed["batch_size"], world_size)
        if fixed.get("accum_steps", layout.accum_steps) == layout.accum_steps:
            return layout
    if fixed:
        given = " x ".join(f"--{name} {value}" for name, value in fixed.items())
        raise LayoutContradiction(
            f"--global_batch_size {global_batch} contradicts {given} on {world_size} "
            f"process(es) ({share} images per process and optimizer step); give "
            "--global_batch_size alone (the accumulation steps are then chosen), or a "
            f"--batch_size that divides {share}"
        )
    batch = max(d for d in range(1, min(max_pass, share) + 1) if share % d == 0)
    return Layout(batch, share // batch, world_size)


def optimizer_batch(cfg: TrainConfig) -> int:
    """Images per optimizer step in each process: --accum_steps loader batches of --batch_size.
    The training loader yields them as one batch, so sample order and resuming do not depend on
    how a step is split into forward/backward passes."""
    return cfg.batch_size * cfg.accum_steps

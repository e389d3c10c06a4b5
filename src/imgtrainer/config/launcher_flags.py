"""The launcher's flags as ``LauncherConfig``, declared once like the trainer's.

``launch_ddp.py``'s parser and the launcher keys a run file may hold are generated from its
fields (``config.parse``); a flag both read is declared once, in ``TrainConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from imgtrainer.config.bounds import AT_LEAST_1, ZERO_OR_MORE, Bound
from imgtrainer.config.schema import TRAIN_FIELDS


def _launch(default: Any, help: str, bounds: Bound | None = None, **meta: Any) -> Any:
    """A field of LauncherConfig: its help as ``--help`` prints it, its bounds, and ``choices``;
    ``run_file=False`` for a flag that only the command line takes."""
    return field(default=default, metadata={"help": help, "bounds": bounds, **meta})


def _trainer_flag(name: str) -> Any:
    """A flag that launcher and trainer both read, declared once in TrainConfig."""
    return field(default=TRAIN_FIELDS[name].default, metadata={"trainer": True})


@dataclass(frozen=True)
class LauncherConfig:
    """The flags of launch_ddp.py, in ``--help`` order; a run file may hold them too, so one file
    serves the launcher and the trainer (the trainer accepts and ignores them)."""

    num_gpus: int | str | None = _launch(
        None, "GPUs to use on this node: a number or 'all' (default: 1)"
    )
    device: str = _trainer_flag("device")
    nproc: int = _launch(1, "processes per node on the CPU (default: 1)", AT_LEAST_1)
    nnodes: int | str = _launch(
        "1",
        "number of nodes, or MIN:MAX for an elastic job (with --resume auto): torchrun "
        "goes on with the nodes left when one is lost (with --max_restarts), and restarts "
        "the workers to take in one that joins; they resume from the newest checkpoint "
        "(default: 1)",
    )
    node_rank: int = _launch(0, "this node's rank, 0..nnodes-1; node 0 hosts the rendezvous")
    master_addr: str = _launch("127.0.0.1", "address of node 0 (default: 127.0.0.1)")
    master_port: int | None = _launch(
        None, "rendezvous port on node 0 (default: a free port on one node, 29500 on several)"
    )
    rdzv_endpoint: str | None = _launch(
        None,
        "HOST:PORT of torchrun's c10d rendezvous (default: --master_addr:--master_port); "
        "for an elastic job a node that stays",
    )
    rdzv_conf: str | None = _launch(
        None,
        "torchrun's --rdzv-conf KEY=VALUE,... (e.g. last_call_timeout=5 for the seconds "
        "an elastic rendezvous waits for more nodes once it has MIN, join_timeout=600)",
    )
    rdzv_id: str = _launch("image-trainer", "rendezvous id, the same on every node of one job")
    max_restarts: int | None = _launch(
        None,
        "times torchrun restarts the workers after a failure; a lost node spends one on each "
        "node left, a node that joins costs none (default: 0; 3 with --nnodes MIN:MAX, so an "
        "elastic job outlives up to 3 lost nodes or crashes)",
        ZERO_OR_MORE,
    )
    start_method: str = _launch(
        "auto",
        "how torchrun starts the workers. fork: as copies of its agent, which imports "
        "torch, torchvision, timm and the trainer once (seconds quicker to the first step); "
        "spawn: as fresh processes, each importing them again (torchrun's default). "
        "auto: fork on the CPU, spawn with CUDA (default: auto)",
        choices=["auto", "fork", "spawn"],
    )
    dry_run: bool = _launch(False, "print the command, run nothing", run_file=False)


LAUNCHER_FIELDS: dict[str, dataclasses.Field] = {
    f.name: f for f in dataclasses.fields(LauncherConfig)
}

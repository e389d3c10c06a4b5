"""Train an image classifier with DistributedDataParallel on images in any data layout.

Run it through the launcher, under torchrun directly, or alone (world size 1):

    python launch_ddp.py --num_gpus 2 --use_amp
    torchrun --nproc_per_node=2 src/train_ddp.py --use_amp
    python src/train_ddp.py --train_dir data/train --val_dir data/val --use_amp
    python src/train_ddp.py --demo --device cpu
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

from imgtrainer import heartbeat, redact
from imgtrainer.checkpoints.remote import check_run_folders, checkpoint_folder
from imgtrainer.checkpoints.run_folder import claim_run_folder
from imgtrainer.config import (
    TrainConfig,
    config_yaml,
    launcher_flags_from_env,
    parse_config,
    preset_summary,
    print_config_requested,
)
from imgtrainer.data import prepare_demo_data
from imgtrainer.distributed.collectives import (
    all_gather_objects,
)
from imgtrainer.distributed.logs import PROJECT_LOGGER, logging_for_run
from imgtrainer.distributed.setup import (
    DistInfo,
    cleanup_distributed,
    setup_distributed,
)
from imgtrainer.errors import RunFailed, exit_on_user_error
from imgtrainer.events import EventLog, event
from imgtrainer.files import atomic_write
from imgtrainer.precision import configure_backends
from imgtrainer.process import TorchrunEnv
from imgtrainer.run.lifecycle import ending_for, exit_now, run_reporting
from imgtrainer.run.summary import log_run_start, log_summary, write_report
from imgtrainer.training.assemble import assemble
from imgtrainer.training.trainer import Trainer

log = logging.getLogger(__name__)


def run(cfg: TrainConfig, dist: DistInfo) -> int:
    project = logging.getLogger(PROJECT_LOGGER)
    with logging_for_run(Path(cfg.log_dir), dist), EventLog().kept(project, dist.is_main) as events:
        try:
            with claim_checkpoint_dir(cfg, dist):
                return train(cfg, dist, events)
        except BaseException as err:
            events.add("stop", **failure(err))
            raise


def failure(err: BaseException) -> dict:
    """The fields of the "stop" event of a run that ``err`` ended: why, its exit code and its
    line (which goes to stderr, not to the log)."""
    code, line, _ = ending_for(err)
    reason = "nonfinite" if isinstance(err, RunFailed) else "signal" if code > 128 else "error"
    return {"reason": reason, "code": code, "text": line, "finished": False}


def write_run_config(cfg: TrainConfig, dist: DistInfo) -> None:
    """<log_dir>/config.yaml: ``python launch_ddp.py --config`` of it repeats this run."""
    if dist.is_main:
        path = Path(cfg.log_dir) / "config.yaml"
        text = config_yaml(cfg, launcher_flags_from_env()).encode()
        atomic_write(path, lambda f: f.write(text), lambda: len(text))
        rerun = f"python launch_ddp.py --config {path}"
        start = event("start", attempt=TorchrunEnv.read().restart_count, rerun=rerun)
        log.info(f"Configuration: {path} (rerun: {rerun})", extra=start)


def claim_checkpoint_dir(cfg: TrainConfig, dist: DistInfo):
    """One run per checkpoint folder, never over another run's results: the main process locks
    the folder (the local copy of one in object storage, which has no locks) and checks it;
    every rank takes part in sharing the verdict."""
    return claim_run_folder(
        checkpoint_folder(cfg),
        partial(check_run_folders, cfg)
        if dist.first_attempt  # restarted workers find their own run's checkpoints
        else None,
        enabled=dist.is_main,
        agree=lambda error: all_gather_objects(error)[0],
    )


def train(cfg: TrainConfig, dist: DistInfo, events: EventLog) -> int:
    write_run_config(cfg, dist)
    if cfg.low_memory:
        log.info(preset_summary(cfg, "low_memory"))
    configure_backends(dist.device, cfg.deterministic)
    prepare_demo_data(cfg, dist)
    trainer = Trainer(assemble(cfg, dist, events))
    try:
        trainer.resume()
        log_run_start(trainer.cfg, dist, trainer)  # the layout chosen for this world size
        with trainer.stop.installed(), watched(trainer):
            finished = trainer.fit()
        trainer.stop.installed_for_wrap_up()
        trainer.end_hooks(finished)
    finally:
        trainer.close()
    log_summary(trainer, finished)
    write_report(trainer.cfg, dist)
    return 0 if finished else trainer.stop.exit_code


@contextlib.contextmanager
def watched(trainer: Trainer) -> Iterator[None]:
    """Training, watched by the launcher's hang watchdog (``run.watchdog``) through this rank's
    heartbeat slot, where the launcher asked for it (--hang_timeout)."""
    slot = heartbeat.open_slot(trainer.dist.rank, TorchrunEnv.read().restart_count)
    heartbeat.start(trainer.global_step)
    try:
        yield
    finally:
        heartbeat.finish()
        if slot is not None:
            slot.close()


@exit_on_user_error
def main(argv: Sequence[str] | None = None) -> int:
    """Bad input is one line and exit code 2, like every tool's ``main``. The command line runs
    the undecorated function under ``run_reporting``, which also reports the line to the
    launcher."""
    env = TorchrunEnv.read()
    cfg = parse_config(argv, env)
    # What libraries read of the command line (W&B's metadata, a traceback) holds no
    # credential: the config keeps the client's copy.
    sys.argv[:] = [redact.text(arg) for arg in sys.argv]
    if print_config_requested(argv):
        print(config_yaml(cfg, launcher_flags_from_env()), end="")
        return 0
    dist = setup_distributed(cfg.device, cfg.dist_timeout_minutes, env)
    try:
        return run(cfg, dist)
    finally:
        cleanup_distributed()


def run_as_script() -> None:
    """``python src/train_ddp.py``: run ``main`` under ``run_reporting`` (which also reports the
    ending to the launcher) and exit without the interpreter's teardown."""
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    try:
        code = run_reporting(main.__wrapped__)
    except BaseException:  # never into multiprocessing's exit (it waits for the loader workers)
        traceback.print_exc()
        code = 1
    exit_now(code)

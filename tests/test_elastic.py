"""Elastic runs: the global batch kept over another number of processes, sample-exact resumes,
torchrun's node range through the launcher, and the refusals."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import imgtrainer.run.launcher as launch_ddp
import imgtrainer.run.train as train_ddp
from conftest import (
    ROOT,
    TINY_FLAGS,
    pack_folder,
    run_cli,
    run_main,
    run_train,
    start_launcher,
    user_error_line,
    write_image_folder,
)
from imgtrainer.checkpoints.resume import changed_settings
from imgtrainer.config import TrainConfig, choose_layout, parse_config
from imgtrainer.data.host.samplers import EpochSampler
from imgtrainer.errors import UserError
from imgtrainer.hooks import HOOKS_ENV, Hook
from imgtrainer.process import TorchrunEnv
from imgtrainer.run.lifecycle import REPORT_DIR_ENV, read_agent_failure, write_agent_failure
from imgtrainer.run.rendezvous import claim_store_host

FAULTS = Path(__file__).parent / "fault_injection"
sys.path.insert(0, str(FAULTS))
from sitecustomize import RECORD_ENV  # noqa: E402
from step_gate import GATE_ENV, write_atomic  # noqa: E402

PREEMPT_ENV = "PREEMPT_AT"

# ----------------------------------------------------------------------------- the sampler


def rank_batches(sampler_args: tuple, world: int, epoch: int, position: int) -> list[list[int]]:
    """Each rank's indices from ``position`` of ``epoch``, at ``world`` processes."""
    shares = []
    for rank in range(world):
        sampler = EpochSampler(sampler_args[0], rank, world, *sampler_args[1:])
        sampler.set_epoch(epoch, position)
        shares.append([index for index, _ in sampler])
        assert len(shares[-1]) == len(sampler)
    return shares


def test_each_step_takes_the_next_global_batch_at_any_world_size():
    args = (48, 3, 12)  # 48 samples, seed 3, global batch 12: 4 steps per epoch
    order = EpochSampler(48, 0, 1, 3, 12)
    order.set_epoch(1)
    full = order.epoch_order()
    assert sorted(full) == list(range(48)) and order.steps_per_epoch == 4
    for world in (1, 2, 3, 4, 6):
        shares = rank_batches(args, world, 1, 24)  # resumed after 2 steps
        per_step = 12 // world
        for step in range(2):
            taken = sorted(
                i for share in shares for i in share[step * per_step : (step + 1) * per_step]
            )
            assert taken == sorted(full[24 + 12 * step : 36 + 12 * step])
    # The partial last global batch is left out, as the loader's drop_last does.
    sampler = EpochSampler(50, 0, 2, 3, 12)
    assert sampler.steps_per_epoch == 4 and len(sampler) == 24


def test_the_epoch_order_is_the_subclass_contract():
    """A sampler that overrides epoch_order() (a balanced one) is split over ranks the same way."""

    class Reversed(EpochSampler):
        def epoch_order(self) -> list[int]:
            return list(reversed(range(self.dataset_size)))

    shares = []
    for rank in range(2):
        sampler = Reversed(8, rank, 2, 0, 4)
        sampler.set_epoch(0, position=4)
        shares.append([index for index, _ in sampler])
    assert shares == [[3, 1], [2, 0]]


# ----------------------------------------------------------------------------- layouts


def test_layout_keeps_the_global_batch_and_the_pass_where_it_can():
    assert choose_layout(32, 2, 16).__dict__ == {
        "batch_size": 16,
        "accum_steps": 1,
        "world_size": 2,
    }
    assert choose_layout(32, 1, 16).accum_steps == 2
    assert (choose_layout(48, 4, 16).batch_size, choose_layout(48, 4, 16).accum_steps) == (12, 1)
    assert (choose_layout(40, 2, 16).batch_size, choose_layout(40, 2, 16).accum_steps) == (10, 2)
    with pytest.raises(
        UserError, match=r"32 images cannot be split evenly over 3 processes.*1, 2, 4, 8, 16, 32"
    ):
        choose_layout(32, 3, 16)


def test_explicit_flags_that_contradict_the_global_batch_are_refused_at_start(capsys):
    cfg = parse_config(
        ["--global_batch_size", "64", "--batch_size", "16"], TorchrunEnv(world_size=2)
    )
    assert (cfg.batch_size, cfg.accum_steps) == (16, 2)
    cfg = parse_config(
        ["--global_batch_size", "64", "--accum_steps", "4"], TorchrunEnv(world_size=2)
    )
    assert (cfg.batch_size, cfg.accum_steps) == (8, 4)
    assert parse_config(["--global_batch_size", "64"], TorchrunEnv(world_size=4)).batch_size == 16
    with pytest.raises(
        UserError,
        match=r"--global_batch_size 64 contradicts --batch_size 16 x --accum_steps 1 on 2",
    ):
        parse_config(
            ["--global_batch_size", "64", "--batch_size", "16", "--accum_steps", "1"],
            TorchrunEnv(world_size=2),
        )
    with pytest.raises(UserError, match="cannot be split evenly over 3 processes"):
        parse_config(["--global_batch_size", "64"], TorchrunEnv(world_size=3))
    # A resume (or a restarted worker) lays the run out again instead.
    resumed = parse_config(
        [
            "--global_batch_size",
            "64",
            "--batch_size",
            "16",
            "--accum_steps",
            "1",
            "--resume",
            "auto",
        ],
        TorchrunEnv(world_size=1),
    )
    assert (resumed.batch_size, resumed.accum_steps) == (16, 4)
    line = user_error_line(
        train_ddp.main, ["--global_batch_size", "30", "--accum_steps", "4"], capsys
    )
    assert "--global_batch_size 30 contradicts --accum_steps 4 on 1 process(es)" in line


def test_a_resume_keeps_the_global_batch_and_refuses_to_change_it():
    config = dict(TrainConfig().to_dict(), batch_size=16, accum_steps=1)
    state = {"config": config, "world_size": 2, "effective_batch_size": 32}
    state["layout"] = {"batch_size": 16, "accum_steps": 1, "world_size": 2}
    assert changed_settings(state, config, 1) == []  # the same flags: 16 x 2 x 1 then
    assert changed_settings(state, config, 4) == []
    [change] = changed_settings(state, dict(config, batch_size=8), 1)
    assert change.endswith("16x1x2=32 -> 8x1x1=8")
    [change] = changed_settings(state, dict(config, global_batch_size=64), 2)
    assert change.endswith("16x1x2=32 -> --global_batch_size 64")


# ----------------------------------------------------------------------------- runs


@pytest.fixture
def elastic_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """32 training images: 2 steps of 16 per epoch."""
    classes = ["cat", "dog"]
    return (
        write_image_folder(tmp_path / "data" / "train", classes, 16, seed=1),
        write_image_folder(tmp_path / "data" / "val", classes, 2, seed=2),
    )


def vit_flags(train: Path, val: Path, *extra: str) -> list[str]:
    """A tiny timm ViT: no BatchNorm, so the weights do not depend on how a step is split."""
    return [
        *("--train_dir", train, "--val_dir", val, *TINY_FLAGS),
        *("--model", "test_vit", "--optimizer", "sgd", "--epochs", "2", "--save_every_steps", "1"),
        *extra,
    ]


def recording_env(folder: Path, **extra: str) -> dict[str, str]:
    path = [str(FAULTS), os.environ.get("PYTHONPATH", "")]
    return {RECORD_ENV: str(folder), "PYTHONPATH": os.pathsep.join(filter(None, path)), **extra}


def used_indices(folder: Path) -> dict[int, list[int]]:
    """Per epoch, the indices of the steps that count: a step run again after a crash counts
    as its last attempt ran it (the crashed attempt's weights were never saved)."""
    records = [json.loads(line) for line in (folder / "indices.jsonl").read_text().splitlines()]
    last = {(r["epoch"], r["step"]): r["attempt"] for r in records}  # appended in time order
    used = defaultdict(list)
    for r in records:
        if last[(r["epoch"], r["step"])] == r["attempt"]:
            used[r["epoch"]] += r["indices"]
    return used


def assert_each_index_once_per_epoch(folder: Path, epochs: int, samples: int) -> None:
    used = used_indices(folder)
    assert sorted(used) == list(range(epochs))
    for epoch, indices in used.items():
        assert sorted(indices) == list(range(samples)), f"epoch {epoch}"


def latest(workdir: Path) -> dict:
    return torch.load(workdir / "checkpoints" / "checkpoint_latest.pth", weights_only=True)


def launch(workdir: Path, flags: list, env: dict, *launcher_flags: str):
    return run_cli(
        [ROOT / "launch_ddp.py", "--device", "cpu", *launcher_flags, *flags], workdir, env=env
    )


def preempt_hook(trainer):
    """SIGUSR1 (SLURM's warning) after step STEP of epoch EPOCH (from 0), as $PREEMPT_AT
    "EPOCH:STEP" says: the preemption a stop saves for."""
    stop_at = tuple(int(part) for part in os.environ[PREEMPT_ENV].split(":"))

    class Preempt(Hook):
        before_checkpoint = True

        def on_step_end(self, info) -> bool:
            if (trainer.epoch, info.step) == stop_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            return False

    return Preempt()


def run_recorded(
    flags: list, workdir: Path, monkeypatch, stop_at: tuple[int, int] | None = None
) -> int:
    """``run_train`` with the index recorder; ``stop_at`` (epoch from 0, step): a SIGTERM
    there, the preemption a stop saves for."""
    with monkeypatch.context() as patch:
        patch.setenv(RECORD_ENV, str(workdir))
        hooks = ["sitecustomize:record_indices"]
        if stop_at is not None:
            patch.setenv(PREEMPT_ENV, f"{stop_at[0]}:{stop_at[1]}")
            hooks.append(f"{__name__}:preempt_hook")
        patch.setenv(HOOKS_ENV, ",".join(hooks))
        return run_train([str(a) for a in flags], workdir)


@pytest.mark.slow
def test_two_one_two_processes_resume_sample_exact_from_shards(
    elastic_dataset, tmp_path, monkeypatch
):
    """2 processes (killed in epoch 1), 1 (stopped by SIGUSR1 in epoch 2), 2 again, at the same
    global batch of 16: every training index once per epoch, the uninterrupted run's step
    count, and its weights to float tolerance. Trained from tar shards (the folder: the two
    agents' tests below; every layout is one ImageTable to the sampler; --sampler window:
    test_remote's job killed at 2 processes and resumed at 1, and test_window_order's units);
    the uninterrupted run reads the folder the shards were packed from, so the two agree on
    the samples behind each index too."""
    folder, val = elastic_dataset
    train = pack_folder(folder, tmp_path / "data" / "shards", "shards", shard_size=10)
    clean, elastic = tmp_path / "clean", tmp_path / "elastic"
    clean.mkdir(), elastic.mkdir()
    assert run_recorded(vit_flags(folder, val, "--accum_steps", "2"), clean, monkeypatch) == 0

    flags = vit_flags(train, val, "--resume", "auto")
    killed = launch(elastic, flags, recording_env(elastic, TRAIN_DDP_KILL_AT="1:2"), "--nproc", "2")
    assert killed.returncode != 0 and latest(elastic)["step"] == 1
    assert run_recorded(flags, elastic, monkeypatch, stop_at=(1, 1)) == 143
    log = (elastic / "logs" / "train_rank_0.log").read_text()
    assert f"Training data: 32 images in 2 classes from tar shards {train} (4 files)" in log
    assert "epoch 1, step 1 of 2 (sample 16 of the epoch's order)" in log
    assert "processes 2 -> 1, layout --batch_size 8 x --accum_steps 2 x 1 process(es) = 16" in log
    assert (latest(elastic)["epoch"], latest(elastic)["epoch_position"]) == (1, 16)
    done = launch(elastic, flags, recording_env(elastic), "--nproc", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "processes 1 -> 2, layout --batch_size 8 x --accum_steps 1 x 2 process(es) = 16"
        in done.stdout
    )

    assert_each_index_once_per_epoch(elastic, 2, 32)
    a, b = latest(clean), latest(elastic)
    assert a["scheduler_state_dict"]["last_epoch"] == b["scheduler_state_dict"]["last_epoch"] == 4
    assert a["effective_batch_size"] == b["effective_batch_size"] == 16
    for name, weight in a["model_state_dict"].items():
        torch.testing.assert_close(b["model_state_dict"][name], weight, rtol=1e-4, atol=1e-5)
    history = json.loads((elastic / "logs" / "training_history.json").read_text())["epochs"]
    assert [r["epoch"] for r in history] == [1, 2]


# ----------------------------------------------------------------------------- the launcher


def dry_run(capsys, *args: str) -> str:
    assert run_main(launch_ddp.main, ["--dry_run", *args]) == 0
    return capsys.readouterr().out


def test_an_elastic_node_range_goes_to_torchrun(capsys):
    cmd = dry_run(
        capsys,
        *("--device", "cpu", "--nnodes", "1:4", "--rdzv_endpoint", "10.1.2.3:29400"),
        *("--max_restarts", "5", "--rdzv_conf", "last_call_timeout=5", "--resume", "auto"),
    )
    assert "--nnodes=1:4" in cmd and "--rdzv-endpoint=10.1.2.3:29400" in cmd
    assert "--max-restarts=5" in cmd and "--rdzv-conf=last_call_timeout=5" in cmd
    assert "--node-rank" not in cmd  # the rendezvous numbers the nodes of each round
    fixed = dry_run(capsys, "--device", "cpu", "--nnodes", "2", "--rdzv_conf", "join_timeout=60")
    assert "--rdzv-conf=is_host=1,join_timeout=60" in fixed and "--nnodes=2 " in fixed
    for bad in ("3:2", "0:2", "1:2:3", "two"):
        line = user_error_line(launch_ddp.main, ["--device", "cpu", "--nnodes", bad], capsys)
        assert "--nnodes" in line and bad in line
    # A joining node restarts the workers as a new start: only --resume auto continues the run.
    for resume in ([], ["--resume", "checkpoints/checkpoint_epoch_001.pth"]):
        line = user_error_line(
            launch_ddp.main, ["--device", "cpu", "--nnodes", "2:3", *resume], capsys
        )
        assert line == (
            "error: --nnodes 2:3 needs --resume auto: when a node joins, torchrun restarts the "
            "workers as a new start, and --resume auto makes them continue from the newest "
            "checkpoint"
        )


def test_an_elastic_job_gets_a_restart_budget_for_lost_nodes(capsys):
    """--nnodes MIN:MAX without --max_restarts: each lost node costs every survivor a restart,
    so 0 would end the job at its first lost node; a given --max_restarts is kept."""
    assert launch_ddp.ELASTIC_MAX_RESTARTS == 3
    elastic = ("--device", "cpu", "--nnodes", "1:4", "--resume", "auto")
    assert "--max-restarts=3" in dry_run(capsys, *elastic)
    assert "--max-restarts=0" in dry_run(capsys, *elastic, "--max_restarts", "0")
    assert "--max-restarts=0" in dry_run(capsys, "--device", "cpu", "--nnodes", "2")
    assert "--max-restarts=0" in dry_run(capsys, "--device", "cpu")
    line = user_error_line(launch_ddp.main, [*elastic, "--max_restarts", "-1"], capsys)
    assert line == "error: --max_restarts must be 0 or more, got -1"


def test_the_first_launcher_on_the_endpoint_host_hosts_the_rendezvous_store(tmp_path):
    """Two launchers of one elastic job on the endpoint's machine: the first started holds the
    port's lock and tells its agent to host the store (is_host=1), the other not to; another
    host, or an is_host of the user's, is left to torch."""
    hosts, lock = claim_store_host("localhost:29555", tmp_path)
    assert hosts is True and lock is not None
    assert claim_store_host("127.0.0.1:29555", tmp_path) == (False, None)
    assert claim_store_host("localhost:29556", tmp_path)[0] is True  # another job's port
    lock.close()  # the first launcher ended: the next one on this machine hosts
    assert claim_store_host("localhost:29555", tmp_path)[0] is True
    assert claim_store_host("192.0.2.1:29555", tmp_path) == (None, None)  # TEST-NET-1
    args = launch_ddp.build_parser().parse_args(
        ["--nnodes", "1:2", "--rdzv_endpoint", "localhost:29555", "--rdzv_conf", "join_timeout=9"]
    )
    for store_host, conf in ((True, "is_host=1,"), (False, "is_host=0,"), (None, "")):
        cmd = launch_ddp.torchrun_command(args, "cpu", 1, [], store_host)
        assert f"--rdzv-conf={conf}join_timeout=9" in cmd
    args.rdzv_conf = "is_host=0"
    assert launch_ddp.elastic_store_host(args) == (None, None)


AGENT_FAILS = """
import os, sys
from imgtrainer.run.lifecycle import write_outcome

class DistNetworkError(RuntimeError):
    pass

def main():
    # Rank 0's worker failed (its peer was lost), then the agent itself failed: lost its
    # rendezvous store (RendezvousConnectionError), or another error of its own.
    os.environ.update(RANK="0", TORCHELASTIC_RESTART_COUNT="0")
    write_outcome(__import__("pathlib").Path(os.environ["TRAIN_DDP_REPORT_DIR"]), 1,
                  "error: RuntimeError: Connection closed by peer", "Traceback: the worker's")
    error = type(os.environ["AGENT_ERROR"], (Exception,), {})
    try:
        raise DistNetworkError("Connection reset by peer")
    except DistNetworkError as cause:
        raise error("The connection to the C10d store has failed.") from cause
"""

RUN_AGENT = """
import sys
from pathlib import Path
from imgtrainer.run import launcher

command = [sys.executable, str(launcher.QUICK_EXIT), "agent_fails:main"]
command.append("--rdzv-endpoint=node0:29400")
sys.exit(launcher.run_torchrun(
    command, dict(__import__("os").environ), Path(sys.argv[1]), resume="python launch_ddp.py -x"
))
"""


def test_the_launcher_names_the_agents_own_failure_not_the_rank_it_was_restarting(tmp_path):
    """torchrun's agent that fails itself is named in the launcher's line, with the rank failure
    it was handling; no rank's traceback. One that lost the rendezvous store (its host is gone)
    gets the line that names that host and the command that continues the run."""
    (tmp_path / "agent_fails.py").write_text(AGENT_FAILS)
    pythonpath = os.pathsep.join([str(tmp_path), str(ROOT / "src")])
    log = tmp_path / "logs" / "torchrun.log"
    lines = {}
    for error in ("RendezvousClosedError", "RendezvousConnectionError"):
        env = {"PYTHONPATH": pythonpath, "AGENT_ERROR": error}
        result = run_cli(["-c", RUN_AGENT, tmp_path / "logs"], tmp_path, timeout=60, env=env)
        assert result.returncode == 1
        assert "Traceback: the worker's" not in result.stderr
        [lines[error]] = result.stderr.strip().splitlines()
    assert lines["RendezvousClosedError"] == (
        "error: torchrun's agent failed: RendezvousClosedError: The connection to the C10d "
        "store has failed. (DistNetworkError: Connection reset by peer); no restart was tried "
        f"after rank 0's failure (RuntimeError: Connection closed by peer) (torchrun's log: {log})"
    )
    assert lines["RendezvousConnectionError"] == (
        "error: the rendezvous host node0:29400 is gone: its torchrun agent held the job's c10d "
        f"store, which a job cannot outlive (torchrun's log: {log}); the checkpoints are kept: "
        "continue with `python launch_ddp.py -x` on each node, starting on the one that will "
        "host the rendezvous at node0:29400 (or with --rdzv_endpoint naming a node that stays)"
    )
    assert "RendezvousConnectionError" in log.read_text()
    # The command that continues: this launcher's, with --resume auto (the last one given wins).
    assert launch_ddp.resume_command(["--nnodes", "2", "--resume", "a b.pth"], "a b.pth") == (
        "python launch_ddp.py --nnodes 2 --resume 'a b.pth' --resume auto"
    )
    assert launch_ddp.resume_command(["--resume", "auto"], "auto").endswith(" --resume auto")


def test_only_the_agents_own_failures_are_reported_as_its_own(tmp_path, monkeypatch):
    """Its workers' failure (ChildFailedError) and its stop signals are reported otherwise."""
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))
    for name in ("ChildFailedError", "SignalException", "KeyboardInterrupt"):
        write_agent_failure(type(name, (Exception,), {})("not the agent's"))
        assert read_agent_failure(tmp_path) is None
    write_agent_failure(type("RendezvousTimeoutError", (Exception,), {})("no quorum\nmore"))
    assert read_agent_failure(tmp_path) == "RendezvousTimeoutError: no quorum"


def test_runs_on_several_nodes_publish_each_rounds_store(monkeypatch):
    """torch's shared agent store keeps the first round's address on its rank 0, which a node
    joining a later round waits for in vain: runs on several nodes opt out of it."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    for nnodes, opt_out in (("1", None), ("2", "1"), ("1:4", "1")):
        args = launch_ddp.build_parser().parse_args(["--nnodes", nnodes])
        env = launch_ddp.torchrun_env(args, "cpu", 1)
        assert env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == opt_out


def wait_for(ready, seconds: float, launcher) -> None:
    """Poll ``ready()`` until true, failing at once if ``launcher`` ends before."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"not ready after {seconds} s"
        time.sleep(0.1)


def with_torchrun_log(stderr: str, log: Path) -> str:
    """A failed launcher's stderr and torchrun's own log (the agents' rendezvous and restarts,
    which the workers' tracebacks do not show)."""
    text = log.read_text() if log.exists() else "(no torchrun.log)"
    return f"{stderr[-3000:]}\n----- {log}:\n{text[-12000:]}"


def agent_group(launcher) -> int:
    """The process group of a launcher's torchrun (its own session): the agent and workers."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    return os.getpgid(int(children[0]))


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["the other agent", "the rendezvous host"])
def test_two_agents_one_sigkilled_the_survivor_finishes(elastic_dataset, tmp_path, lost):
    """Two torchrun agents (--nnodes 1:2, c10d on localhost, one process each), one SIGKILLed
    with its worker after a mid-epoch checkpoint. The second agent lost: the survivor restarts
    its worker on its own, at world size 1. The first, which hosts the rendezvous store, lost:
    the survivor ends (exit 1) with one line naming that host and the command that continues,
    the checkpoint kept; that command, run here, hosts the rendezvous itself and goes on at
    world size 1. Either way: every epoch once in the history, each index once per epoch, the
    uninterrupted run's step count."""
    train, val = elastic_dataset
    workdir = tmp_path / "run"
    workdir.mkdir()
    endpoint = f"localhost:{launch_ddp.free_port()}"
    # The rendezvous drops a node whose keep-alive is keep_alive_interval x
    # keep_alive_max_attempt seconds old (torch's default 5 x 3 = 15 s): 1 x 4 here, so the
    # survivor's next round waits 4 s for the killed node to be declared gone, not 15 s. The
    # last call (the wait for more nodes once one is in, each round): 4 s, for the second agent
    # to join the first round (it joins within a second of the first: both start importing
    # torch at about the same time).
    conf = "last_call_timeout=4,keep_alive_interval=1,keep_alive_max_attempt=4"
    elastic = [
        *("--device", "cpu", "--nproc", "1", "--nnodes", "1:2", "--rdzv_endpoint", endpoint),
        *("--max_restarts", "2", "--rdzv_id", "elastic-test", "--rdzv_conf", conf),
    ]
    flags = [*elastic, *vit_flags(train, val, "--resume", "auto")]
    # Both ranks held after step 1 and its checkpoint until the kill (an epoch is 2 steps): it
    # lands after the mid-epoch checkpoint and before the epoch's end, whatever the speeds.
    # LOGLEVEL: torchrun's agents log their rendezvous rounds and restarts (shown on a failure).
    gate = tmp_path / "gate"
    gate.mkdir()
    write_atomic(gate / "gate", "1 0")
    hold = {GATE_ENV: str(gate), HOOKS_ENV: "step_gate:hold_at_gate"}
    env = recording_env(workdir, LOGLEVEL="INFO", **hold)
    first = start_launcher(flags, workdir, env=env)
    # The first launcher claims the rendezvous store (run.rendezvous) before it starts torchrun:
    # its torchrun hosts it, whichever agent imports torch first; both join the first round.
    torchrun_log = workdir / "logs" / "torchrun.log"
    wait_for(lambda: torchrun_log.exists(), 60, first)
    second = start_launcher(flags, workdir, env=env)
    wait_for(lambda: all((gate / f"held.rank{r}").exists() for r in (0, 1)), 300, first)
    assert latest(workdir)["world_size"] == 2 and latest(workdir)["step"] == 1
    victim, survivor = (second, first) if lost == "the other agent" else (first, second)
    os.killpg(agent_group(victim), signal.SIGKILL)
    victim.kill()
    write_atomic(gate / "gate", f"{1 << 40} 0")  # the survivor's rank goes on, to lose its peer
    stdout, stderr = survivor.communicate(timeout=300)
    victim.communicate()
    if lost == "the rendezvous host":
        assert "is_host=0" in stdout  # the survivor's agent did not host the store
        assert survivor.returncode == 1, with_torchrun_log(stderr, torchrun_log)
        [line] = stderr.strip().splitlines()
        assert line.startswith(f"error: the rendezvous host {endpoint} is gone: "), line
        assert (latest(workdir)["world_size"], latest(workdir)["step"]) == (2, 1)  # kept
        command = shlex.split(line.split("`")[1])
        assert command[:2] == ["python", str(ROOT / "launch_ddp.py")], line
        # The printed command, on this machine: it hosts the rendezvous now, and goes on alone.
        resumed = run_cli(command[1:], workdir, env=env)
        stdout, stderr = resumed.stdout, resumed.stderr
        assert resumed.returncode == 0, with_torchrun_log(stderr, torchrun_log)
    else:
        assert survivor.returncode == 0, with_torchrun_log(stderr, torchrun_log)
    assert "is_host=1" in stdout  # the agent that finished hosted the store
    assert "processes 2 -> 1, layout --batch_size 8 x --accum_steps 2 x 1 process(es)" in stdout
    history = json.loads((workdir / "logs" / "training_history.json").read_text())["epochs"]
    assert [r["epoch"] for r in history] == [1, 2]
    assert_each_index_once_per_epoch(workdir, 2, 32)
    final = latest(workdir)
    assert final["effective_batch_size"] == 16 and final["scheduler_state_dict"]["last_epoch"] == 4


def on_core(core: int):
    """A Popen preexec_fn: the launcher and its processes on one core, a node of its own (two
    nodes' ranks of two threads each on 2 shared cores take seconds per step)."""
    return lambda: os.sched_setaffinity(0, {core % (os.cpu_count() or 1)})


@pytest.mark.slow
def test_an_agent_that_joins_a_running_job_is_taken_in(elastic_dataset, tmp_path):
    """One agent (--nnodes 1:2) trains alone, held after each step while it is alone; once its
    first checkpoint exists a second agent starts. The first sees it waiting and stops its
    worker (SIGTERM: a checkpoint mid-epoch); both agents' workers resume at world size 2:
    every epoch once in the history, each index once per epoch, the uninterrupted run's step
    count and global batch."""
    train, val = elastic_dataset
    workdir = tmp_path / "run"
    workdir.mkdir()
    endpoint = f"localhost:{launch_ddp.free_port()}"
    elastic = [
        *("--device", "cpu", "--nproc", "1", "--nnodes", "1:2", "--rdzv_endpoint", endpoint),
        *("--max_restarts", "2", "--rdzv_id", "join-test", "--rdzv_conf", "last_call_timeout=1"),
    ]
    # A global batch of 8: 4 steps per epoch, so the second agent joins mid-epoch.
    flags = [*elastic, *vit_flags(train, val, "--resume", "auto", "--global_batch_size", "8")]
    env = recording_env(workdir, TRAIN_DDP_STEP_DELAY="60:1")  # cut short by the agent's SIGTERM
    first = start_launcher(flags, workdir, env=env, preexec_fn=on_core(0))
    checkpoint = workdir / "checkpoints" / "checkpoint_latest.pth"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert latest(workdir)["world_size"] == 1 and latest(workdir)["step"] == 1
    second = start_launcher(flags, workdir, env=env, preexec_fn=on_core(1))
    stdout, stderr = first.communicate(timeout=120)
    second_stderr = second.communicate(timeout=60)[1]
    torchrun_log = workdir / "logs" / "torchrun.log"
    assert first.returncode == 0, with_torchrun_log(stderr, torchrun_log)
    assert second.returncode == 0, with_torchrun_log(second_stderr, torchrun_log)
    assert "processes 1 -> 2, layout --batch_size 4 x --accum_steps 1 x 2 process(es) = 8" in stdout
    # The first agent stopped its worker itself (nothing signalled the launchers).
    assert "via signal SIGTERM" in (workdir / "logs" / "torchrun.log").read_text()
    history = json.loads((workdir / "logs" / "training_history.json").read_text())["epochs"]
    assert [r["epoch"] for r in history] == [1, 2]
    assert_each_index_once_per_epoch(workdir, 2, 32)
    records = [json.loads(line) for line in (workdir / "indices.jsonl").read_text().splitlines()]
    assert {r["world_size"] for r in records if r["epoch"] == 0} == {1, 2}  # joined mid-epoch
    final = latest(workdir)
    assert final["world_size"] == 2 and final["effective_batch_size"] == 8
    assert final["scheduler_state_dict"]["last_epoch"] == 8


FORWARD_SCRIPT = """
import os, signal, sys, threading, time
from imgtrainer.run.launcher import run_forwarding_signals

ready = sys.argv[1]
child = (
    "import os, signal, sys, time\\n"
    "ignored = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN\\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\\n"
    "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(9))\\n"
    # A child of its own that nothing else ends (as one wedged at its fork): its pid, then sleep.
    "left = os.fork()\\n"
    "time.sleep(60) if left == 0 else open(sys.argv[1], 'w').write(str(left))\\n"
    # Written whole, then renamed: the signal may come as soon as the name exists.
    f"open({ready!r} + '.tmp', 'w').write(str(ignored))\\n"
    f"os.rename({ready!r} + '.tmp', {ready!r})\\n"
    "time.sleep(60)\\n"
)

def warn_when_ready():
    while not os.path.exists(ready):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning before the time limit

threading.Thread(target=warn_when_ready, daemon=True).start()
command = [sys.executable, "-c", child, ready + ".left"]
received, code = run_forwarding_signals(command, dict(os.environ), None)
print(received, code)
"""


def test_the_launcher_passes_slurms_sigusr1_on_as_sigterm(tmp_path):
    """torchrun's agent stops its workers on SIGTERM (SIGUSR1 would end it at once); it starts
    with SIGUSR1 ignored, for SLURM's warning sent to every process of the step, and a worker
    that handles SIGUSR1 still gets it. Nothing of torchrun's session outlives it."""
    result = run_cli(
        ["-c", FORWARD_SCRIPT, tmp_path / "ready"],
        tmp_path,
        timeout=60,
        env={"PYTHONPATH": str(ROOT / "src")},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"[{int(signal.SIGUSR1)}]", "7"]
    assert (tmp_path / "ready").read_text() == "True"  # torchrun started with SIGUSR1 ignored
    left = Path(f"/proc/{(tmp_path / 'ready.left').read_text()}/stat")
    assert not left.exists() or left.read_text().rsplit(")", 1)[1].split()[0] == "Z"

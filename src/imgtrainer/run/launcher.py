"""Launch src/train_ddp.py under torchrun on 1..N GPUs (or CPU processes), on one or more nodes.

    python launch_ddp.py --num_gpus 2 --use_amp              # 2 GPUs, DDP + AMP
    python launch_ddp.py --nnodes 1:4 --rdzv_endpoint HOST:29500 --resume auto ...  # elastic

The launcher's own flags are parsed here; every other flag goes unchanged to the workers. It
never imports torch (its checks are ``run.preflight``'s), forwards stop signals to torchrun and
exits with the code of how the run ended (docs/development.md: the processes of a run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from imgtrainer import redact
from imgtrainer.config import (
    LAUNCHER_FIELDS,
    LAUNCHER_FLAGS_ENV,
    LAUNCHER_KEYS,
    add_launcher_flags,
    check_bound,
    config_yaml,
    hang_seconds,
    parse_config,
    read_run_file,
    run_file_parser,
)
from imgtrainer.errors import UserError, exit_on_user_error
from imgtrainer.events import LAUNCHER_EVENTS, append_event
from imgtrainer.heartbeat import HEARTBEAT_DIR_ENV
from imgtrainer.process import (
    STOP_SIGNALS,
    TorchrunEnv,
    cuda_not_visible,
    die_with_parent,
    gpus_may_be_shared,
    visible_gpu_count,
)
from imgtrainer.run.lifecycle import REPORT_DIR_ENV, read_agent_failure, read_outcomes
from imgtrainer.run.outcome import LOST_STORE, exit_code, report_agent_failure, report_lost_store
from imgtrainer.run.preflight import launcher_checks
from imgtrainer.run.rendezvous import claim_store_host
from imgtrainer.run.watchdog import Watchdog, WatchPlan

SRC = Path(__file__).resolve().parents[2]  # the folder of the thin scripts
TRAIN_SCRIPT = SRC / "train_ddp.py"
QUICK_EXIT = SRC / "quick_exit.py"
TRAINER_MODULE = "imgtrainer.run.train"  # what the agent imports before forking the workers
TORCHRUN_LOG = "torchrun.log"
START_METHODS = tuple(LAUNCHER_FIELDS["start_method"].metadata["choices"])


def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags, one per field of ``config.LauncherConfig``."""
    parser = argparse.ArgumentParser(
        prog="launch_ddp.py",
        add_help=False,
        description="Run src/train_ddp.py under torchrun. Launcher flags are listed first; "
        "every other flag is passed to the trainer (listed after them).",
    )
    parser.add_argument("-h", "--help", action="store_true", help="show both sets of flags")
    add_launcher_flags(parser)
    return parser


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_device_and_nproc(args: argparse.Namespace) -> tuple[str, int]:
    """Which device the trainer uses and how many processes run on this node. The GPUs are
    counted without torch (``visible_gpu_count``); each worker then checks its own device."""
    visible = visible_gpu_count()
    device = args.device if args.device != "auto" else ("cuda" if visible else "cpu")
    if device == "cuda" and not visible:
        raise UserError(cuda_not_visible("use --device cpu (with --nproc N for N processes)"))
    if device == "cpu":
        return device, cpu_processes(args)
    return device, gpu_processes(args.num_gpus, visible)


def cpu_processes(args: argparse.Namespace) -> int:
    """--nproc, unless --num_gpus asked for GPUs that are not there."""
    if args.num_gpus not in (None, "1") and args.device == "auto":
        raise UserError(
            f"--num_gpus {args.num_gpus} asked for {args.num_gpus} GPUs but 0 are "
            "visible; use --device cpu --nproc N to train on the CPU"
        )
    check_bound("nproc", args.nproc)
    return args.nproc


def gpu_processes(num_gpus: str | None, visible: int) -> int:
    """The GPUs --num_gpus asks for (default 1, or 'all' of the ``visible`` ones)."""
    requested = num_gpus or "1"
    if requested == "all":
        return visible
    if not requested.isdigit() or int(requested) < 1:
        raise UserError(f"--num_gpus must be a positive number or 'all', got {requested}")
    if int(requested) > visible and not gpus_may_be_shared():
        raise UserError(
            f"--num_gpus {requested} asked for {requested} GPUs but only {visible} "
            f"are visible; use --num_gpus {visible} (or --num_gpus all)"
        )
    return int(requested)


def start_method(args: argparse.Namespace, device: str) -> str:
    """fork on the CPU; spawn (torchrun's default) with CUDA unless asked otherwise.

    A forked worker starts in a fraction of a second where a spawned one imports torch,
    torchvision and timm again. The agent never runs a torch operation nor touches CUDA (it
    only imports), which is what forking needs; but CUDA forbids a child to use it once the
    parent initialised it, and that cannot be tested on a machine without a GPU, so CUDA runs
    keep fresh processes unless --start_method fork is given."""
    if args.start_method not in START_METHODS:  # from a run file: argparse checks flags only
        raise UserError(
            f"start_method must be one of {', '.join(START_METHODS)}, got {args.start_method!r}"
        )
    if args.start_method != "auto":
        return args.start_method
    return "fork" if device == "cpu" else "spawn"


def node_range(nnodes: object) -> tuple[int, int]:
    """--nnodes N or MIN:MAX as (min, max)."""
    text = str(nnodes)
    parts = text.split(":")
    if len(parts) > 2 or not all(part.isdigit() for part in parts):
        raise UserError(f"--nnodes takes a number of nodes or MIN:MAX, got {text!r}")
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high:
        raise UserError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {text!r}")
    return low, high


def check_elastic_resume(nnodes: object, resume: str | None) -> None:
    """An elastic job restarts its workers when a node joins without counting a restart (the
    workers' TORCHELASTIC_RESTART_COUNT stays), so only --resume auto lets them continue."""
    low, high = node_range(nnodes)
    if low < high and resume != "auto":
        raise UserError(
            f"--nnodes {nnodes} needs --resume auto: when a node joins, torchrun restarts the "
            "workers as a new start, and --resume auto makes them continue from the newest "
            "checkpoint"
        )


ELASTIC_MAX_RESTARTS = 3  # --max_restarts of an elastic job that does not give it


def restart_budget(max_restarts: int | None, nnodes: object) -> int:
    """--max_restarts, or where it is not given 0 for a fixed number of nodes and
    ``ELASTIC_MAX_RESTARTS`` for --nnodes MIN:MAX: a lost node makes every surviving agent
    restart its workers once (their collectives fail), so an elastic job with no budget ended
    at its first lost node. Joins cost nothing (torchrun does not count them)."""
    if max_restarts is not None:
        check_bound("max_restarts", max_restarts)
        return max_restarts
    low, high = node_range(nnodes)
    return ELASTIC_MAX_RESTARTS if low < high else 0


def rendezvous_endpoint(args: argparse.Namespace, several_nodes: bool) -> str:
    if args.rdzv_endpoint:
        return args.rdzv_endpoint
    port = args.master_port or (29500 if several_nodes else free_port())
    return f"{args.master_addr}:{port}"


def torchrun_command(
    args: argparse.Namespace,
    device: str,
    nproc: int,
    trainer_args: list[str],
    store_host: bool | None = None,
) -> list[str]:
    """torchrun's command line; ``store_host``: whether this node's agent hosts an elastic
    job's rendezvous store (``run.rendezvous``; None: torch guesses from the endpoint)."""
    low, high = node_range(args.nnodes)
    elastic = low < high
    if not elastic and not 0 <= args.node_rank < high:
        raise UserError(f"--node_rank must be in 0..{high - 1}, got {args.node_rank}")
    # torchrun (torch.distributed.run:main), through src/quick_exit.py: no interpreter teardown
    # at its end (seconds, after importing torch).
    if start_method(args, device) == "fork":
        # The agent imports the trainer (torch, torchvision, timm) once; torchrun forks the
        # workers from it and runs the script in them with runpy (--run-path). -u: the workers
        # inherit the agent's streams, unbuffered as torchrun's "python -u" workers are.
        agent = [sys.executable, "-u", str(QUICK_EXIT), "--preload", TRAINER_MODULE]
        script = ["--start-method=fork", "--run-path", str(TRAIN_SCRIPT)]
    else:
        agent, script = [sys.executable, str(QUICK_EXIT)], [str(TRAIN_SCRIPT)]
    command = [
        *agent,
        "torch.distributed.run:main",  # the torchrun command
        f"--nnodes={low}:{high}" if elastic else f"--nnodes={high}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous_endpoint(args, high > 1)}",
        f"--rdzv-id={args.rdzv_id}",
        f"--max-restarts={restart_budget(args.max_restarts, args.nnodes)}",
    ]
    # Elastic: the agent on the endpoint's host holds the rendezvous store (torchrun finds it by
    # its address), and the rendezvous numbers the nodes of each round.
    conf = [args.rdzv_conf] if args.rdzv_conf else []
    if elastic and store_host is not None:
        conf.insert(0, f"is_host={int(store_host)}")
    if high > 1 and not elastic:
        # Ranks are assigned by the rendezvous; node 0 hosts its store at master_addr:port.
        command.append(f"--node-rank={args.node_rank}")
        conf.insert(0, f"is_host={1 if args.node_rank == 0 else 0}")
    if conf:
        command.append(f"--rdzv-conf={','.join(conf)}")
    return command + [*script, "--device", device, *trainer_args]


def print_help(parser: argparse.ArgumentParser) -> None:
    from imgtrainer.config import build_parser as trainer_parser

    parser.print_help()
    print("\ntrainer flags (passed through to src/train_ddp.py):")
    trainer_help = trainer_parser().format_help()
    print(trainer_help[trainer_help.index("options:") + len("options:") :].rstrip())


def run_torchrun(
    command: list[str],
    env: dict[str, str],
    log_dir: Path,
    hang_watch: tuple[float | None, int, bool] = (None, 0, True),
    resume: str = "the same command with --resume auto",
) -> int:
    """Run torchrun with its stderr in LOG_DIR/torchrun.log, and return the run's exit code.
    ``hang_watch``: (--hang_timeout in seconds or None for off, --max_restarts, whether this
    node runs every rank) for the hang watchdog (``run.watchdog``), which watches this node's
    ranks from here; ``resume``: the command that continues the run (``resume_command``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / TORCHRUN_LOG
    with (
        tempfile.TemporaryDirectory(prefix="train_ddp_report_") as reports,
        open(log_file, "ab") as log,
    ):
        shown = redact.text(shlex.join(command))
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shown}\n".encode())
        append_event(log_dir / LAUNCHER_EVENTS, "launch", command=shown)
        log.flush()
        env = {**env, REPORT_DIR_ENV: reports}
        timeout, max_restarts, whole_job = hang_watch
        watchdog = None
        if timeout is not None:
            env[HEARTBEAT_DIR_ENV] = str(Path(reports) / "heartbeat")
            folder = Path(reports) / "heartbeat"
            plan = WatchPlan(folder, timeout, log_dir, max_restarts, log_file, whole_job)
            watchdog = Watchdog(plan)
        with watchdog or contextlib.nullcontext():
            received, code = run_forwarding_signals(command, env, log)
        hangs = [verdict for verdict, _ in watchdog.hangs] if watchdog else []
        agent = None if code == 0 or received or hangs else read_agent_failure(Path(reports))
        if agent and agent.startswith(LOST_STORE):
            flag = "--rdzv-endpoint="
            endpoint = next((a[len(flag) :] for a in command if a.startswith(flag)), "unknown")
            return report_lost_store(endpoint, resume, log_file)
        if agent:
            return report_agent_failure(agent, read_outcomes(Path(reports)), code, log_file)
        return exit_code(code, read_outcomes(Path(reports)), received, log_file, hangs)


def run_forwarding_signals(
    command: list[str], env: dict[str, str], stderr
) -> tuple[list[int], int]:
    """Run torchrun in its own session and hand it the stop signals ourselves, so one Ctrl-C
    reaches each worker once (through torchrun) instead of from two directions. Linux stops
    torchrun (SIGTERM: a clean stop with a checkpoint) if the launcher dies, however it dies.
    Returns the signals received and torchrun's exit code."""
    launcher = os.getpid()
    child = subprocess.Popen(
        command,
        env=env,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=partial(_die_with, launcher),
    )
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        # torchrun's agent stops its workers on SIGTERM; SIGUSR1 would end it at once.
        child.send_signal(signal.SIGTERM if signum == signal.SIGUSR1 else signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    code = child.wait()
    # Its session's leftovers: a child wedged at its fork (CPython < 3.11.8) has no death signal.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    return received, (128 - code if code < 0 else code)


def _die_with(parent: int) -> None:
    """In torchrun, before it starts: SIGTERM when the launcher dies, and SIGUSR1 ignored.
    SLURM sends its time-limit warning (``--signal=USR1``) to every process of a job step:
    torchrun's agent does not handle it and would die at once, taking the rendezvous store it
    may host with it. The launcher passes it on as SIGTERM; the workers install their own
    handler for it (ignored dispositions survive exec, handlers replace them)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def launcher_defaults(run_file: dict) -> dict:
    """The launcher's own keys of a run file, as its parser's defaults (``device`` is both a
    launcher and a trainer flag)."""
    defaults = {k: v for k, v in run_file.items() if k in LAUNCHER_FIELDS}
    if "num_gpus" in defaults:
        defaults["num_gpus"] = str(defaults["num_gpus"])
    return defaults


def resolved_launcher_flags(args: argparse.Namespace, nproc: int) -> dict:
    """The launcher flags that a run file must hold to repeat this run."""
    flags = {name: getattr(args, name) for name in LAUNCHER_KEYS}
    flags["nproc"] = nproc if args.num_gpus is None else None
    flags["nnodes"] = int(args.nnodes) if str(args.nnodes).isdigit() else str(args.nnodes)
    if args.start_method == "auto":
        flags["start_method"] = None
    return {k: v for k, v in flags.items() if v is not None}


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, trainer_args = parser.parse_known_args(argv)
    if args.help:
        print_help(parser)
        return 0
    # A run file's launcher keys are defaults that the command line overrides; the file itself
    # goes to the workers unchanged (they read its trainer keys).
    run_flags, _ = run_file_parser().parse_known_args(trainer_args)
    if run_flags.config:
        parser.set_defaults(**launcher_defaults(read_run_file(run_flags.config)))
        args, trainer_args = parser.parse_known_args(argv)
    device, nproc = resolve_device_and_nproc(args)
    # Bad input found without torch: one line and exit 2 here, before torchrun starts.
    cfg = parse_config(
        ["--device", device, *trainer_args],
        TorchrunEnv(world_size=nproc * node_range(args.nnodes)[0]),
    )
    check_elastic_resume(args.nnodes, cfg.resume)
    if run_flags.print_config:
        print(config_yaml(cfg, resolved_launcher_flags(args, nproc)), end="")
        return 0
    store_host, lock = (None, None) if args.dry_run else elastic_store_host(args)
    try:  # the lock (an elastic job's rendezvous store hosted here) is held while torchrun runs
        command = torchrun_command(args, device, nproc, trainer_args, store_host)
        print("Running: " + redact.text(shlex.join(command)), flush=True)
        if args.dry_run:
            return 0
        launcher_checks(cfg, device, world_size=nproc * node_range(args.nnodes)[0])
        one_node = node_range(args.nnodes)[1] == 1
        restarts = restart_budget(args.max_restarts, args.nnodes)
        hang_watch = (hang_seconds(cfg.hang_timeout), restarts, one_node)
        env = torchrun_env(args, device, nproc)
        resume = resume_command(sys.argv[1:] if argv is None else argv, cfg.resume)
        return run_torchrun(command, env, Path(cfg.log_dir), hang_watch, resume)
    finally:
        if lock is not None:
            lock.close()


def resume_command(argv: list[str], resume: str | None) -> str:
    """This launcher's command with --resume auto (the last --resume given wins)."""
    script = sys.argv[0] if sys.argv[0].endswith("launch_ddp.py") else "launch_ddp.py"
    flags = argv if resume == "auto" else [*argv, "--resume", "auto"]
    return redact.text(shlex.join(["python", script, *map(str, flags)]))


def elastic_store_host(args: argparse.Namespace):
    """``rendezvous.claim_store_host`` for an elastic job that does not say itself (is_host)."""
    low, high = node_range(args.nnodes)
    if low == high or "is_host=" in (args.rdzv_conf or ""):
        return None, None
    return claim_store_host(rendezvous_endpoint(args, True))


def torchrun_env(args: argparse.Namespace, device: str, nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env[LAUNCHER_FLAGS_ENV] = json.dumps(resolved_launcher_flags(args, nproc))
    # torchrun would force 1 thread per worker; the trainer sets its share of the cores itself.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if device == "cpu":
        # A CPU run on a GPU machine must not touch CUDA: torch's optimizers query the CUDA
        # stream in every step when a GPU is visible, which fails ("initialization error") in
        # workers forked from an agent whose imports initialised CUDA.
        env["CUDA_VISIBLE_DEVICES"] = ""
    if node_range(args.nnodes)[1] > 1:
        # Each rendezvous round publishes its own store address: with torch's shared agent store,
        # a node that joins a later round waits for an address that the returning rank 0 never
        # publishes again (it keeps the first round's), and the round times out.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env

"""A real single-node SLURM cluster on localhost for the tests (tests/test_slurm.py): munged,
slurmctld and slurmd started from a folder of their own (keys, sockets, state, logs), on free
ports, without cgroups, and stopped again by their process ids.

Debian's ``slurm-wlm`` and ``munge`` packages (SLURM 22.05, munge 0.5) provide the programs;
``.ci/install-slurm`` installs them where the machine allows (root and apt). ``why_not`` says
why a cluster cannot start here, for the test to skip with.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
NODE = "node1"
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}
# How long a requeued job waits before it may start again: AuthInfo's cred_expire (120 s by
# default) + 1 s. The smallest SLURM allows is 5 s.
CRED_EXPIRE_S = 5

SLURM_CONF = """\
ClusterName=imgtrainer
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
JobRequeue=1
ReturnToService=2
KillWait=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=1,bf_interval=1
NodeName={node} NodeAddr=127.0.0.1 NodeHostname=localhost CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
# cgroup/v1 with IgnoreSystemd: the plugin loads in a container without systemd; nothing here
# uses cgroups (proctrack/linuxproc, task/none), but slurmd reads the file. ("disabled" is not
# a plugin in 22.05.)
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n"


def why_not() -> str | None:
    """Why a cluster cannot start on this machine, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "slurmd and munged need root; the tests run as another user"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} missing; as root on Debian or Ubuntu, "
            ".ci/install-slurm installs them)"
        )
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + slurmd in the foreground, as this process's children; ``env`` is
    what SLURM's commands need to reach them."""

    def __init__(self, cpus: int = 2):
        # munged wants its socket's folder, and the folders above it, open to every user:
        # a folder of its own in /tmp, not pytest's (mode 0700).
        self.root = Path(tempfile.mkdtemp(prefix="imgtrainer-slurm-"))
        self.root.chmod(0o755)
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        self.started_at = 0.0

    @property
    def env(self) -> dict[str, str]:
        """This process's environment without any SLURM job's or sbatch's settings, pointed
        at this cluster."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
        }
        return {**env, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 30) -> None:
        """Start the daemons and wait for the node to be idle; RuntimeError (with the logs)
        when it is not within ``timeout`` seconds."""
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        for folder in ("state", "spool"):
            (self.root / folder).mkdir()
        (self.root / "cgroup.conf").write_text(CGROUP_CONF)
        self.conf.write_text(
            SLURM_CONF.format(
                host=socket.gethostname().split(".")[0],
                ctld_port=free_port(),
                slurmd_port=free_port(),
                munge_socket=munge / "socket",
                cred_expire=CRED_EXPIRE_S,
                root=self.root,
                node=NODE,
                cpus=self.cpus,
            )
        )
        self._daemon(
            "munged",
            "--foreground",
            f"--key-file={key}",
            f"--socket={munge / 'socket'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        )
        self._wait_for(lambda: (munge / "socket").exists(), timeout, "munged's socket")
        self.started_at = time.time()
        self._daemon("slurmctld", "-D", "-i", "-f", self.conf)
        self._daemon("slurmd", "-D", "-N", NODE, "-f", self.conf)
        self._wait_for(self._node_idle, timeout, f"node {NODE} idle")

    def _daemon(self, program: str, *args: object) -> None:
        log = open(self.root / f"{program}.out", "wb")  # noqa: SIM115 - closed with the process
        self.daemons.append(
            subprocess.Popen(
                [program, *map(str, args)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()

    def _node_idle(self) -> bool:
        out = self.command("sinfo", "-h", "-N", "-o", "%T", check=False).stdout
        return out.strip().startswith("idle")

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not ready():
            dead = [d for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"SLURM did not start ({what}): {self.log_tail()}")
            time.sleep(0.2)

    def command(
        self, *args: object, check: bool = True, env: dict[str, str] | None = None, cwd=None
    ) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster (sbatch, scontrol, ...), its output as text;
        ``env``: variables on top of ``self.env``."""
        result = subprocess.run(
            [str(a) for a in args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, args))}: {result.stderr.strip()}")
        return result

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields, or {} once SLURM has forgotten the job."""
        out = self.command("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def completion_records(self, job_id: str) -> list[dict[str, str]]:
        """The job's records in SLURM's job completion log (jobcomp/filetxt): one per start
        that ended, a requeued one included."""
        path = self.root / "jobcomp.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        records = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in lines]
        return [r for r in records if r.get("JobId") == job_id]

    def log_tail(self, lines: int = 15) -> str:
        tails = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            if text:
                tails.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def _all_jobs_ended(self) -> bool:
        out = self.command("squeue", "-h", "-t", "all", "-o", "%T", check=False).stdout
        return set(out.split()) <= ENDED

    def stop(self) -> None:
        """Cancel every job (its processes end with it), then stop the daemons, by their ids."""
        if any(d.poll() is None for d in self.daemons[1:]):
            # SIGKILL to every process of every running job (a batch script's trap included),
            # then cancel them all, pending ones too.
            self.command("scancel", "--partition=test", "--full", "--signal=KILL", check=False)
            self.command("scancel", "--partition=test", check=False)
            end = time.monotonic() + 20
            while time.monotonic() < end and not self._all_jobs_ended():
                time.sleep(0.2)
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        shutil.rmtree(self.root, ignore_errors=True)

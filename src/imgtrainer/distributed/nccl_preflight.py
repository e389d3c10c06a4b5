"""A pre-flight for the known causes of NCCL hangs, run by every rank as it joins the group.

Peer-to-peer access that the driver reports but that does not work (NCCL is told not to use
it), NCCL or driver versions that differ between nodes (named), and a rank whose first
all-reduce does not finish within seconds (named, instead of a 30-minute timeout). The device
queries are parameters, so the logic runs on the CPU with them faked (docs/troubleshooting.md).
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from imgtrainer.errors import RunFailed

# accelerate's rule (utils/environment.py, check_cuda_p2p_ib_support, used by `accelerate
# launch`): on a node of more than one GPU whose name holds one of these, with a driver older
# than P2P_FIXED_DRIVER, the driver reports peer-to-peer access that does not work, and NCCL
# hangs or corrupts data over it; it sets both settings (each only when the user has not).
P2P_UNRELIABLE_NAMES = ("RTX 40",)
P2P_FIXED_DRIVER = "550.40.07"
P2P_SETTINGS = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
PROBE_SECONDS = 60.0  # the first all-reduce also connects the ranks
GATHER_SECONDS = 300.0  # every rank reaches the pre-flight after its imports


@dataclass(frozen=True)
class NodeFacts:
    """What one rank's device queries say."""

    rank: int
    host: str
    gpus: tuple[str, ...]  # the names of the GPUs this node's processes use
    driver: str  # the NVIDIA driver's version, "" where unknown
    nccl: str  # the NCCL version torch was built with
    made: tuple[str, ...] = ()  # the settings this rank made, "KEY=VALUE"

    @classmethod
    def from_json(cls, text: str) -> NodeFacts:
        data = json.loads(text)
        return cls(**{**data, "gpus": tuple(data["gpus"]), "made": tuple(data["made"])})


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def p2p_unreliable(gpus: tuple[str, ...], driver: str) -> bool:
    """accelerate's rule: several GPUs, one of them of P2P_UNRELIABLE_NAMES, an older driver
    (an unknown driver counts as older)."""
    if len(gpus) < 2 or not any(n in name for name in gpus for n in P2P_UNRELIABLE_NAMES):
        return False
    return not driver or version_key(driver) < version_key(P2P_FIXED_DRIVER)


def p2p_settings(facts: NodeFacts, environ: Mapping[str, str]) -> dict[str, str]:
    """The settings this node needs and the user has not made."""
    if not p2p_unreliable(facts.gpus, facts.driver):
        return {}
    return {key: value for key, value in P2P_SETTINGS.items() if key not in environ}


def version_mismatch(everyone: list[NodeFacts]) -> str:
    """ "" when every host runs the same NCCL and driver; else which hosts run which."""
    parts = []
    for what in ("nccl", "driver"):
        hosts: dict[str, list[str]] = {}
        for facts in everyone:
            names = hosts.setdefault(getattr(facts, what) or "unknown", [])
            if facts.host not in names:
                names.append(facts.host)
        if len(hosts) > 1:
            label = "NCCL" if what == "nccl" else "driver"
            parts.append(
                "; ".join(f"{label} {version} on {', '.join(h)}" for version, h in hosts.items())
            )
    return " | ".join(parts)


@dataclass(frozen=True)
class Preflight:
    """What the pre-flight found and set, as one line (``line``) and a warning (``warning``:
    versions that differ between hosts, "" when none)."""

    line: str
    warning: str


def before_joining(
    facts: NodeFacts,
    gather: Callable[[NodeFacts], list[NodeFacts]],
    environ: MutableMapping[str, str],
) -> list[NodeFacts]:
    """The settings this node needs, made in ``environ`` (NCCL reads them when it connects),
    then every rank's facts with what it made (``gather``: through the rendezvous store)."""
    settings = p2p_settings(facts, environ)
    environ.update(settings)
    return gather(replace(facts, made=tuple(f"{k}={v}" for k, v in settings.items())))


def probe(
    all_reduce: Callable[[float], float],
    arrived: Callable[[], set[int]],
    everyone: list[NodeFacts],
    seconds: float = PROBE_SECONDS,
) -> float:
    """A small all-reduce (every rank adds rank + 1) bounded by ``seconds``; its time, or
    ``RunFailed`` naming the ranks that never reached it (``arrived``: the ranks that did), or
    the transport when they all did."""
    world = len(everyone)
    start = time.monotonic()
    try:
        total = all_reduce(seconds)
    except (TimeoutError, RuntimeError) as error:
        missing = [f for f in everyone if f.rank not in arrived()]
        if missing:
            named = ", ".join(f"rank {f.rank} on {f.host}" for f in missing)
            raise RunFailed(
                f"the NCCL pre-flight's all-reduce did not finish in {seconds:g} s: {named} "
                "never reached it (stuck before its first collective); the others waited"
            ) from error
        raise RunFailed(
            f"the NCCL pre-flight's all-reduce did not finish in {seconds:g} s though all "
            f"{world} ranks reached it: NCCL's transport between them hangs (try "
            "NCCL_P2P_DISABLE=1, NCCL_IB_DISABLE=1 or NCCL_SOCKET_IFNAME; NCCL_DEBUG=INFO "
            f"says which it uses) [{type(error).__name__}]"
        ) from error
    expected = world * (world + 1) / 2
    if total != expected:
        raise RunFailed(
            f"the NCCL pre-flight's all-reduce returned {total:g} instead of {expected:g}: data "
            "is corrupted between GPUs (peer-to-peer access that does not work?); set "
            "NCCL_P2P_DISABLE=1"
        )
    return time.monotonic() - start


def summary(everyone: list[NodeFacts], seconds: float) -> str:
    """One line: what was found on how many hosts, what was set where, the probe's time."""
    hosts: dict[str, NodeFacts] = {}
    for facts in everyone:
        if facts.made or facts.host not in hosts:
            hosts[facts.host] = facts
    made = "; ".join(
        f"set {' '.join(f.made)} on {host} ({len(f.gpus)} x {f.gpus[0]}, driver "
        f"{f.driver or 'unknown'}: peer-to-peer access that the driver reports does not work)"
        for host, f in hosts.items()
        if f.made
    )
    first = everyone[0]
    return (
        f"NCCL pre-flight: {len(everyone)} rank(s) on {len(hosts)} host(s), NCCL {first.nccl}, "
        f"driver {first.driver or 'unknown'}; {made or 'nothing set'}; all-reduce probe "
        f"{seconds:.2f} s"
    )


def run_preflight(
    facts: NodeFacts,
    gather: Callable[[NodeFacts], list[NodeFacts]],
    join: Callable[[], None],
    all_reduce: Callable[[float], float],
    arrived: Callable[[], set[int]],
    environ: MutableMapping[str, str],
) -> Preflight:
    """The whole pre-flight around ``join`` (init_process_group), each query a parameter."""
    everyone = before_joining(facts, gather, environ)
    join()
    seconds = probe(all_reduce, arrived, everyone)
    return Preflight(summary(everyone, seconds), version_mismatch(everyone))


# ----------------------------------------------------------------------------- torch's queries


def driver_version(path: Path = Path("/proc/driver/nvidia/version")) -> str:
    """The NVIDIA kernel module's version ("NVRM version: NVIDIA UNIX ... Kernel Module
    550.54.14 ..."), "" where it cannot be read."""
    try:
        words = path.read_text().split()
    except OSError:
        return ""
    return next((w for w in words if w.count(".") >= 1 and version_key(w) > (100,)), "")


def local_facts(rank: int, local_world_size: int) -> NodeFacts:
    import torch

    count = min(torch.cuda.device_count(), max(1, local_world_size))
    nccl = torch.cuda.nccl.version()
    return NodeFacts(
        rank=rank,
        host=socket.gethostname(),
        gpus=tuple(torch.cuda.get_device_name(i) for i in range(count)),
        driver=driver_version(),
        nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
    )


def store_gather(store, world_size: int, seconds: float = GATHER_SECONDS):
    """``gather`` through the rendezvous store: each rank's facts under its key."""

    def gather(facts: NodeFacts) -> list[NodeFacts]:
        store.set(f"preflight/facts/{facts.rank}", json.dumps(asdict(facts)))
        keys = [f"preflight/facts/{r}" for r in range(world_size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=seconds))
        except RuntimeError as error:  # torch's DistStoreError on a timeout
            missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
            raise RunFailed(
                f"the NCCL pre-flight waited {seconds:g} s for rank(s) {', '.join(missing)}, "
                "which never reached the process group"
            ) from error
        return [NodeFacts.from_json(store.get(key).decode()) for key in keys]

    return gather


def torch_probe(store, device, rank: int, world_size: int):
    """(``all_reduce``, ``arrived``) over the NCCL process group and the store."""
    import torch
    import torch.distributed as torch_dist

    def all_reduce(seconds: float) -> float:
        store.set(f"preflight/probe/{rank}", "1")
        value = torch.full((1,), float(rank + 1), device=device)
        work = torch_dist.all_reduce(value, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=seconds))  # raises when it runs over
        return float(value.item())

    def arrived() -> set[int]:
        return {r for r in range(world_size) if store.check([f"preflight/probe/{r}"])}

    return all_reduce, arrived

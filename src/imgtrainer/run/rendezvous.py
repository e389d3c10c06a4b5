"""Which agent of an elastic job hosts torchrun's rendezvous store, decided without torch.

The first launcher on the endpoint's machine holds a lock for its port while it runs and says
``is_host=1``, the next ones ``is_host=0``; on other hosts torch's guess stands. torch's own
choice among agents on one host is the first to reach that point after importing torch, and the
agent that hosts the store is the one node an elastic job cannot lose (docs/multi-node.md).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import tempfile
from pathlib import Path
from typing import IO

LOCK_NAME = "imgtrainer-rdzv-{port}.lock"


def addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:  # unknown name
        return set()


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names this machine: a loopback address, or one of this host's names'."""
    wanted = addresses(host)
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in wanted):
        return True
    own: set[str] = set()
    for name in {socket.gethostname(), socket.getfqdn()}:
        own |= addresses(name)
    return bool(wanted & own)


def claim_store_host(
    endpoint: str, lock_dir: Path | None = None
) -> tuple[bool | None, IO[str] | None]:
    """(whether this node's agent hosts the store of ``endpoint``, the lock to hold open while
    it runs): (True, lock) for the first launcher on the endpoint's machine, (False, None) for
    the next ones, (None, None) where torch's own guess stands (another host, or no lock)."""
    host, _, port = endpoint.rpartition(":")
    if not host or not is_this_machine(host.strip("[]")):
        return None, None
    path = (lock_dir or Path(tempfile.gettempdir())) / LOCK_NAME.format(port=port)
    try:
        lock = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+")
    except OSError:  # another user's lock file: leave it to torch
        return None, None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return False, None
    return True, lock

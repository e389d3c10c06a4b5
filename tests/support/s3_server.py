"""A real S3-protocol server on 127.0.0.1 for the tests and bench/remote.py: moto's server mode
(``moto[server]``), reached through the real clients (boto3, s3fs), and a small loopback proxy
in front of it that adds latency to every request or stalls the ones it is told to."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def s3_env(endpoint: str) -> dict[str, str]:
    """What the clients need: fixed keys (moto takes any), no lookup of the instance metadata
    service (an address off this machine), none of the machine's own profiles."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


@dataclass
class S3Server:
    """moto's S3 server on a free port of 127.0.0.1; ``stop`` ends it."""

    endpoint: str = ""
    _server: object = None

    @classmethod
    def start(cls) -> S3Server:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        return cls(f"http://{host}:{port}", server)

    def stop(self) -> None:
        self._server.stop()

    def env(self) -> dict[str, str]:
        return s3_env(self.endpoint)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **_keys())

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def upload(self, folder: Path, url: str) -> str:
        """Every file under ``folder`` to ``url`` (``s3://bucket/prefix``), as ``aws s3 sync``."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        client = self.client()
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                key = "/".join(filter(None, [prefix, path.relative_to(folder).as_posix()]))
                client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
        return url

    def keys(self, url: str) -> list[str]:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        found = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        return sorted(item["Key"] for item in found)


def _keys() -> dict[str, str]:
    return {
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }


@dataclass
class LatencyProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target`` (host, port): each request (each chunk
    a client sends after the server has answered) waits ``delay`` seconds first, as a distant
    store's round trip; ``stall(match)`` makes requests whose first bytes contain ``match``
    hang with half of their first chunk sent (an upload killed half-way): ``release`` lets
    them go on, ``stop`` drops them. Counts the requests and the bytes the server answered."""

    target: tuple[str, int]
    delay: float = 0.0
    requests: int = 0
    request_lines: list[str] = field(default_factory=list)  # "GET /bucket/key HTTP/1.1", ...
    answered_bytes: int = 0
    stalled: list[list] = field(default_factory=list)  # [bytes to match, matches to let by]
    stalling: threading.Event = field(default_factory=threading.Event)  # one is held now
    _released: threading.Event = field(default_factory=threading.Event)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _socket: socket.socket | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> str:
        self._socket = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()
        return f"http://127.0.0.1:{self._socket.getsockname()[1]}"

    def stall(self, match: bytes, after: int = 0) -> None:
        """Hang the requests whose first bytes hold ``match``, once ``after`` of them passed."""
        self.stalled.append([match, after])

    def _stalls(self, data: bytes) -> bool:
        with self._lock:
            for rule in self.stalled:
                if rule[0] in data:
                    rule[1] -= 1
                    return rule[1] < 0
        return False

    def release(self) -> None:
        """The stalled requests go on, and no more are stalled."""
        self.stalled.clear()
        self._released.set()

    def stop(self) -> None:
        self._stopped.set()  # the stalled requests end too
        if self._socket is not None:
            self._socket.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._socket.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        answered = True  # the next bytes from the client start a request
        try:
            while True:
                ready, _, _ = select.select([client, upstream], [], [], 60)
                if not ready:
                    return
                if client in ready:
                    data = client.recv(1 << 16)
                    if not data or (answered and not self._start_request(data, upstream)):
                        return
                    if not answered:
                        upstream.sendall(data)
                    answered = False
                if upstream in ready:
                    data = upstream.recv(1 << 16)
                    if not data:
                        return
                    answered = not data.startswith(b"HTTP/1.1 100 ")  # 100: the body follows
                    with self._lock:
                        self.answered_bytes += len(data)
                    client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def _start_request(self, data: bytes, upstream: socket.socket) -> bool:
        """Count a request's first chunk, wait ``delay``, stall it if told, and send it on;
        False when a stalled request is dropped (``stop``)."""
        with self._lock:
            self.requests += 1
            self.request_lines.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
        if self.delay:
            time.sleep(self.delay)
        if self._stalls(data):
            upstream.sendall(data[: len(data) // 2])
            data = data[len(data) // 2 :]
            self.stalling.set()
            while not self._released.wait(0.05):
                if self._stopped.is_set():
                    return False
        upstream.sendall(data)
        return True


def proxied(server: S3Server, delay: float) -> tuple[LatencyProxy, str]:
    """A ``LatencyProxy`` of ``delay`` seconds in front of ``server``, and its endpoint."""
    host, port = server.endpoint.removeprefix("http://").split(":")
    proxy = LatencyProxy((host, int(port)), delay)
    return proxy, proxy.start()

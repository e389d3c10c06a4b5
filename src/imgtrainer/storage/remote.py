"""Object stores through fsspec: one filesystem per process, every failure one line,
transient ones retried with backoff.

s3fs for S3; gcsfs and adlfs work where installed."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from imgtrainer import redact
from imgtrainer.errors import UserError, first_line

log = logging.getLogger(__name__)

T = TypeVar("T")

INSTALL = "pip install -r requirements-remote.txt"

# What S3 gets unless --storage_options says otherwise: a start that cannot reach its endpoint
# fails in seconds, not after botocore's default minutes; enough connections for the read-ahead.
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {
        "connect_timeout": 5,
        "read_timeout": 30,
        "retries": {"max_attempts": 3, "mode": "standard"},
        "max_pool_connections": 64,
    },
    "use_listings_cache": False,  # a run lists once; checkpoints are listed as they change
}

# Errors, by class name anywhere in the chain, that a later try may not meet: timeouts,
# dropped or refused connections, 5xx answers (botocore's, aiohttp's, fsspec's own).
TRANSIENT_NAMES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "IncompleteRead",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientConnectorError",
    "ClientOSError",
    "FSTimeoutError",
    "HTTPClientError",
}
SERVER_ERRORS = ("InternalError", "ServiceUnavailable", "SlowDown", "503", "500", "502", "504")
RETRIES = 5  # tries of one read or write: backoff 0.25, 0.5, 1, 2 s (with jitter) between them
# A store that has not answered a process's first request by then is named at once: the
# client's own retries of a read timeout (3 tries x s3fs's 5, 30 s each) take minutes.
PROBE_SECONDS = 5.0


def is_url(path: str) -> bool:
    """Whether ``path`` names an object in a store (``s3://``, ``gs://``, ``az://``, ...)."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme.isidentifier() and scheme != "file"


def protocol_of(url: str) -> str:
    return url.partition("://")[0]


def parse_options(text: str) -> dict[str, Any]:
    """--storage_options: a JSON object of keyword arguments for the store's filesystem."""
    try:
        options = json.loads(text or "{}")
    except ValueError as err:
        raise UserError(f"--storage_options is not JSON ({err}): give an object, e.g. "
                        '\'{"endpoint_url": "http://127.0.0.1:9000"}\'') from None  # fmt: skip
    if not isinstance(options, dict):
        raise UserError("--storage_options must be a JSON object of the store's options")
    # A run file this run wrote holds its credentials redacted: the store then takes them from
    # the environment, or from --storage_options given again.
    return redact.without_marks(options)


def filesystem_options(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options given, over this project's defaults for ``protocol`` (nested dicts merged)."""
    merged = json.loads(json.dumps(S3_DEFAULTS)) if protocol in ("s3", "s3a") else {}
    for key, value in options.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


_FILESYSTEMS: dict[tuple, Any] = {}
_MAKING: dict[int, threading.Lock] = {}  # per process: a forked child never inherits a held one


def filesystem(url: str, options_text: str) -> Any:
    """This process's fsspec filesystem for ``url``'s protocol and the options: made once per
    process (a forked loader worker makes its own: the parent's event loop is not its own)."""
    protocol = protocol_of(url)
    # The environment names the endpoint and the credentials: a change makes another client.
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (os.getpid(), protocol, options_text, env)
    if key in _FILESYSTEMS:
        return _FILESYSTEMS[key]
    with _MAKING.setdefault(os.getpid(), threading.Lock()):  # the reading threads make one
        if key not in _FILESYSTEMS:
            # A forked loader worker's parent probed the same store: no request of its own.
            parent = next((fs for made, fs in _FILESYSTEMS.items() if made[1:] == key[1:]), None)
            _FILESYSTEMS[key] = fs = _make_filesystem(
                url, protocol, options_text, parent is not None
            )
            _share_models(parent, fs)
    return _FILESYSTEMS[key]


def _share_models(parent: Any, fs: Any) -> None:
    """s3fs in a forked process: its client made with the API models (botocore's data loader)
    its parent's client parsed, not parsed again: 0.07 s of CPU, not 0.2, per process."""
    session = getattr(parent, "session", None)
    if session is None or getattr(fs, "session", "") is not None:
        return  # not s3fs, or the parent made no client
    from aiobotocore.session import AioSession

    fs.session = AioSession(**fs.kwargs)  # as s3fs makes its own, at its first request
    fs.session.register_component("data_loader", session.get_component("data_loader"))


def _make_filesystem(url: str, protocol: str, options_text: str, probed: bool = False) -> Any:
    """A new filesystem for ``url``, its store probed (``probe``) unless ``probed``."""
    try:
        import fsspec
    except ImportError:
        raise UserError(f"{url}: reading object storage needs fsspec: {INSTALL}") from None
    options = filesystem_options(protocol, parse_options(options_text))
    try:
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
    except ImportError as err:
        raise UserError(f"{url}: {first_line(err)}: {INSTALL}") from None
    except ValueError as err:  # an unknown protocol
        raise UserError(f"{url}: {first_line(err)}") from None
    except TypeError as err:  # an option the filesystem does not take
        raise UserError(f"--storage_options for {protocol}://: {first_line(err)}") from None
    if not probed:
        probe(fs, url)
    return fs


def probe(fs: Any, url: str) -> None:
    """One request about ``url`` within ``PROBE_SECONDS``: ``UserError`` if the store does
    not answer, has no credentials or the client refuses an option; any answer (the object
    missing, access denied) passes, for the call that follows to name."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.exceptions import FSTimeoutError

    deadline = {"timeout": PROBE_SECONDS} if isinstance(fs, AsyncFileSystem) else {}
    try:
        if hasattr(fs, "connect"):  # s3fs: the client is made first, outside the deadline
            fs.connect()
        fs.info(url, **deadline)  # fsspec's sync() takes the timeout
    except FSTimeoutError:
        raise UserError(no_answer(url, f"nothing in {PROBE_SECONDS:.0f} s")) from None
    except TypeError as err:  # an option the client takes only at its first request
        raise UserError(f"--storage_options for {protocol_of(url)}://: {first_line(err)}") from None
    except Exception as err:
        names = {cls.__name__ for e in _chain(err) for cls in type(e).__mro__}
        if is_transient(err) or names & {"NoCredentialsError", "PartialCredentialsError"}:
            raise UserError(problem(err, url)) from None


def _chain(err: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    while err is not None and all(err is not seen for seen in found):
        found.append(err)
        err = err.__cause__ or err.__context__
    return found


def is_transient(err: BaseException) -> bool:
    """A timeout, a dropped or refused connection, or a 5xx answer: worth another try."""
    for e in _chain(err):
        if isinstance(e, (FileNotFoundError, PermissionError)):
            return False
        if isinstance(e, (TimeoutError, ConnectionError, socket.timeout)):
            return True
        if any(cls.__name__ in TRANSIENT_NAMES for cls in type(e).__mro__):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status >= 500:
                return True
        if isinstance(e, OSError) and any(word in str(e) for word in SERVER_ERRORS):
            return True
    return False


_JITTER = random.Random()  # never the global stream: a resume restores that one


def retried(call: Callable[[], T], attempts: int = RETRIES) -> T:
    """``call()``, tried again with exponential backoff after a transient failure."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as err:
            if attempt == attempts - 1 or not is_transient(err):
                raise
            time.sleep(0.25 * 2**attempt * (0.5 + _JITTER.random()))
    raise AssertionError("unreachable")


def problem(err: BaseException, url: str) -> str:
    """What went wrong reaching ``url``, in one line with the fix."""
    names = {cls.__name__ for e in _chain(err) for cls in type(e).__mro__}
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return (
            f"{url}: no credentials for the store (set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or --storage_options '{\"anon\": true}' for a "
            "public bucket)"
        )
    if any(isinstance(e, FileNotFoundError) for e in _chain(err)):
        return f"{url}: no such bucket or object"
    if any(isinstance(e, PermissionError) for e in _chain(err)) or "AccessDenied" in str(err):
        return f"{url}: access denied ({first_line(err)}); check the credentials and the bucket"
    if is_transient(err):
        return no_answer(url, first_line(err))
    return f"{url}: {first_line(err)}"


def no_answer(url: str, detail: str) -> str:
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    where = f" at {endpoint}" if endpoint else ""
    return (
        f"{url}: the store{where} does not answer ({detail}); check the endpoint "
        "(AWS_ENDPOINT_URL or --storage_options) and the network"
    )


def as_user_error(call: Callable[[], T], url: str) -> T:
    """``call()``, any failure one ``UserError`` line: for the checks at start (the client's
    own retries only: an endpoint that does not answer is named within seconds)."""
    try:
        return call()
    except UserError:
        raise
    except Exception as err:
        raise UserError(problem(err, url)) from None

"""Credentials stay in memory: every value a run writes or shows passes through here first.

A credential is the value of a ``--storage_options`` key that names a key, secret, token,
password or credential (s3fs's ``key``/``secret``/``token``, adlfs's ``account_key``/
``sas_token``, gcsfs's ``token``, any nested one), and the user and password of a URL. The
values a process is given are remembered (``remember``) and replaced by ``MARK`` in any text
(``text``); options and configs are redacted by their keys even where nothing was remembered.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from typing import Any

MARK = "<redacted>"
# Option names whose values are credentials: what s3fs, gcsfs, adlfs and botocore call them.
SECRET_NAME = re.compile(r"key|secret|token|passw|credential|sas|signature|auth", re.IGNORECASE)
# Option names that hold no secret although they match (s3fs's key of a flag or a file path).
NOT_SECRET = {"use_ssl", "key_file_path"}
USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s\"']*@)")

_remembered: set[str] = set()
_lock = threading.Lock()


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name)) and name not in NOT_SECRET


def remember(values: Iterable[str]) -> None:
    """Credentials of this process, replaced by ``MARK`` wherever ``text`` sees them."""
    with _lock:
        _remembered.update(v for v in values if isinstance(v, str) and len(v) >= 4)


def text(value: str) -> str:
    """``value`` with every remembered credential and every URL's user info replaced."""
    for secret in sorted(_remembered, key=len, reverse=True):
        value = value.replace(secret, MARK)
    return USERINFO.sub(lambda m: f"{m['scheme']}{MARK}@", value)


def secrets_of(options: Any) -> list[str]:
    """The credential values in parsed options (any depth), and the passwords in their URLs."""
    found = []
    if isinstance(options, dict):
        for key, value in options.items():
            if is_secret_name(str(key)) and isinstance(value, (str, int, float)):
                found.append(str(value))
            else:
                found += secrets_of(value)
    elif isinstance(options, list):
        for value in options:
            found += secrets_of(value)
    elif isinstance(options, str):
        found += [m["userinfo"][:-1] for m in USERINFO.finditer(options)]
    return found


def redacted(options: Any) -> Any:
    """Parsed options with each credential's value replaced by ``MARK`` (any depth)."""
    if isinstance(options, dict):
        return {
            key: MARK if is_secret_name(str(key)) and value is not None else redacted(value)
            for key, value in options.items()
        }
    if isinstance(options, list):
        return [redacted(value) for value in options]
    return text(options) if isinstance(options, str) else options


def options_text(value: str) -> str:
    """``--storage_options``' JSON text as it may be written: its credentials replaced."""
    try:
        parsed = json.loads(value or "{}")
    except ValueError:
        return text(value)
    return value if not parsed else json.dumps(redacted(parsed))


def without_marks(options: Any) -> Any:
    """Options read back from a file this run wrote: the redacted values left out, so that the
    store takes its credentials from the environment (or the flag given again)."""
    if isinstance(options, dict):
        return {k: without_marks(v) for k, v in options.items() if v != MARK}
    return options

"""User-facing errors: one clear line on stderr and exit code 2, never a traceback; a closed
output pipe (``| head``) ends a tool quietly.

Every command-line tool of the project wraps its ``main`` with :func:`exit_on_user_error`.
Code anywhere below raises :class:`UserError` for problems the user can fix (bad flags, missing
folders, corrupt files); unexpected failures keep their traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from imgtrainer import redact

EXIT_USER_ERROR = 2


# What a shell reports for a process ended by SIGPIPE (128 + 13), e.g. `tool --help | head`.
EXIT_BROKEN_PIPE = 141


F = TypeVar("F", bound=Callable)


class UserError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""


EXIT_RUN_FAILED = 1


class RunFailed(Exception):
    """A run that cannot go on for a reason that is not a bug (its training diverged): one
    line and exit code 1, never a traceback."""


def exit_on_user_error(main: F) -> F:
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            # One write: ranks never interleave in a line. Credentials never in it.
            sys.stderr.write(redact.text(f"error: {err}\n"))
            sys.stderr.flush()
            sys.exit(EXIT_USER_ERROR)
        except RunFailed as err:
            sys.stderr.write(redact.text(f"error: {err}\n"))
            sys.stderr.flush()
            sys.exit(EXIT_RUN_FAILED)
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly. Point stdout at /dev/null so the
            # interpreter's final flush of what is still buffered cannot fail a second time.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_BROKEN_PIPE)

    return wrapper  # type: ignore[return-value]


def message_line(text: str) -> str:
    """The first non-blank line of an error message, stripped; "" for a blank message (CUDA
    errors and torch's loaders add hints on the lines after the first)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def first_line(err: BaseException, *, name: str | None = None, text: str | None = None) -> str:
    """``Type: first line`` of an error, for a one-line report; the type alone when its message
    is blank. ``name`` replaces the type's name, ``text`` the message (a cleaned copy of it)."""
    name = type(err).__name__ if name is None else name
    line = message_line(str(err) if text is None else text)
    return f"{name}: {line}" if line else name

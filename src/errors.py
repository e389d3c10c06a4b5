"""User-facing errors: one clear line on stderr and exit code 2, never a traceback.

Every command-line tool of the project wraps its ``main`` with :func:`exit_on_user_error`.
Code anywhere below raises :class:`UserError` for problems the user can fix (bad flags, missing
folders, corrupt files); unexpected failures keep their traceback.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

EXIT_USER_ERROR = 2

F = TypeVar("F", bound=Callable)


class UserError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""


def exit_on_user_error(main: F) -> F:
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper  # type: ignore[return-value]

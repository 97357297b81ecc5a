"""Errors that are the user's to fix. The command line prints them as one line (`error: ...`) and exits
with status 2, without a traceback (HYDRA_FULL_ERROR=1 shows it). Anything else is a bug and keeps its
traceback. Every message names the value, where it came from (a key, a file and row) and the fix.
`one_line_errors` decorates a command's entry function so that this holds for every command.
"""

from __future__ import annotations

import functools
import os
import sys


class UserError(Exception):
    """A mistake in what the user gave: a config value, a data file, a checkpoint, a run dir."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work; raised before any data is read or model built."""


class DataError(UserError, ValueError):
    """A data directory, file, column, row or label that cannot be read as configured."""


class CheckpointError(UserError, ValueError):
    """A checkpoint path that is missing, corrupt, not mhalab's, or does not fit the config."""


class RunDirError(UserError):
    """A run dir that cannot be used: held by another live process, or not writable."""


USER_ERROR_EXIT = 2


def exit_with(error: UserError) -> None:
    """Print a user error as one line and exit 2 (or raise it, for the traceback, under HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_EXIT)


def one_line_errors(fn):
    """Decorate a command's entry function (under @hydra.main too) so user errors print as one line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            exit_with(e)

    return wrapper

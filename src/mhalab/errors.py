"""Errors that are the user's to fix. The command line prints them as one line (`error: ...`) and exits
with status 2, without a traceback (HYDRA_FULL_ERROR=1 shows it). Anything else is a bug and keeps its
traceback. Every message names the value, where it came from (a key, a file and row) and the fix.
"""


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

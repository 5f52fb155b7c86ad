"""User-facing errors.

A `UserError` is a mistake the user can fix (a bad config value, a missing file, an incompatible
artifact). Its message names the file, line or config field and says what to do; the CLI prints it
as one line `dllm: error: ...` and exits with code 2. Programmer errors stay `assert`/`RuntimeError`.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input; the message is one line and says what to do."""

    exit_code = 2


class ConfigError(UserError):
    """A config file or override that does not validate."""


class DataError(UserError):
    """An input corpus or prepared artifact that is missing, malformed or incompatible."""


class CheckpointError(UserError):
    """A checkpoint or run folder that is missing or does not match the config."""


class TrainingError(UserError):
    """A run that cannot go on as configured (a loss or gradient that is not finite)."""

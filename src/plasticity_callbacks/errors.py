"""The package's errors: each message is one line that names the value, file or run at fault and the fix."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the field and the choices."""


class CheckpointError(ValueError):
    """A checkpoint (or run-state file) that cannot be written or trusted; the message is one line."""


class ResumeError(RuntimeError):
    """A resume (or a second run) that would not continue the interrupted run faithfully; one-line message."""

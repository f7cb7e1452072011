"""Exceptions a user can act on: each message names the file, field or value at fault."""


class MixtralInferError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(MixtralInferError, ValueError):
    """params.json (or a ModelArgs) is missing a field, has a wrong type or inconsistent values."""


class CheckpointError(MixtralInferError):
    """A model folder or weights file is missing, unreadable, or does not match params.json."""


class GenerationError(MixtralInferError, ValueError):
    """A generation setting or prompt is out of range."""

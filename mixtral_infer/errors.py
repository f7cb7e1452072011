"""Exceptions a user can act on: each message names the file, field or value at fault; and
``as_int``, which the checks that raise them share."""

import operator
import sys
from typing import Optional


class MixtralInferError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(MixtralInferError, ValueError):
    """params.json (or a ModelArgs) is missing a field, has a wrong type or inconsistent values."""


class CheckpointError(MixtralInferError):
    """A model folder or weights file is missing, unreadable, or does not match params.json."""


class GenerationError(MixtralInferError, ValueError):
    """A generation setting or prompt is out of range."""


def as_int(value: object) -> Optional[int]:
    """``value`` as a Python int if it is an integer of any kind (numpy, a 0-d torch integer), else None.

    >>> import numpy, torch
    >>> as_int(numpy.int64(5)), as_int(torch.tensor(7)), as_int(2.0), as_int(True)
    (5, 7, None, None)
    """
    torch = sys.modules.get("torch")  # a value can only be a tensor once torch is imported
    is_tensor = torch is not None and isinstance(value, torch.Tensor)
    if isinstance(value, bool) or (is_tensor and (value.dim() != 0 or value.dtype == torch.bool)):
        return None  # a one-element tensor would also pass operator.index
    try:
        return operator.index(value)
    except TypeError:
        return None

"""Where a model can run and what it can compute in: the checks ``load_model`` and the command
line share, so that a device or dtype this machine cannot give is said before any weight is read.
torch is imported where a check needs it: the command line reads ``DTYPE_NAMES`` without it.

>>> checked_device("cpu", "device='cpu'"), checked_dtype("bfloat16", "dtype='bfloat16'")
(device(type='cpu'), torch.bfloat16)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from mixtral_infer.errors import ConfigError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what the command line's --dtype takes


def default_device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def checked_device(device: object, label: str) -> torch.device:
    """``device`` (a name or a torch.device) if a model can run there on this machine, else
    ConfigError starting with ``label`` (``device='cuda'``, ``--device cuda``); None: the default."""
    import torch

    if device is None:
        return default_device()
    try:
        named = isinstance(device, (str, torch.device)) or (isinstance(device, int) and not isinstance(device, bool))
        place = torch.device(device) if named else None  # an int: an index of the accelerator, as torch reads it
    except RuntimeError:
        if isinstance(device, int):  # and this machine has none
            message = "an index names a CUDA or MPS device, and none is available here (use cpu)"
            raise ConfigError(f"{label}: {message}") from None
        place = None
    if place is None:
        raise ConfigError(f"{label} is not a torch device (try cpu or cuda)")
    if place.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{label}: CUDA is not available on this machine (torch {torch.__version__}; use cpu)")
        if place.index is not None and place.index >= torch.cuda.device_count():
            raise ConfigError(f"{label}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif place.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"{label}: MPS is not available on this machine (use cpu)")
    elif place.type != "cpu":
        held = " (it holds no data)" if place.type == "meta" else ""
        raise ConfigError(f"{label}: a model runs on cpu, cuda or mps, not {place.type}{held}")
    elif place.index not in (None, 0):  # torch takes cpu:1 and runs on the one CPU device anyway
        raise ConfigError(f"{label}: the CPU is one device, cpu (an index names a CUDA device: cuda:{place.index})")
    return place


def checked_dtype(dtype: object, label: str) -> Optional[torch.dtype]:
    """A floating torch dtype, or its name (``"bfloat16"``), as a torch dtype; None stays None."""
    import torch

    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2:
        return dtype  # float64 too: a reference to check others against
    raise ConfigError(f"{label} is not a floating dtype a model computes in: use one of {', '.join(DTYPE_NAMES)}")

"""What the fast paths do, as one object passed in: ``Tuning``.

``load_model(..., fast=True)`` swaps fast modules in for the reference's (``fast.formats``);
``fast=False``, or ``MIXTRAL_INFER_REFERENCE=1`` in the environment, keeps the readable
reference everywhere: plain ``F.linear``, SDPA attention, eager decoding. Quantized weights then
run as ``dequantize`` followed by ``F.linear``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

REFERENCE_VARIABLE = "MIXTRAL_INFER_REFERENCE"


@dataclass(frozen=True)
class Tuning:
    """``fast``: swap in the fast modules and kernels; False: the reference path everywhere."""

    fast: bool = True

    @classmethod
    def default(cls) -> "Tuning":
        """The tuning a model gets when none is passed: fast unless ``MIXTRAL_INFER_REFERENCE=1``."""
        return cls(fast=os.environ.get(REFERENCE_VARIABLE, "") not in ("1", "true", "yes"))

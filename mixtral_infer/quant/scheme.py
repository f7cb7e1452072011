"""What a quantized model's weights are: the scheme's name, 4-bit group sizes, w8a8's activations.

Kept apart from the quantizing code (``quant/weights.py``) and free of torch, so the command
line checks ``--quantize`` at once, before it imports anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mixtral_infer.errors import ConfigError

SCHEMES = ("int8", "int4", "nf4")
FOUR_BIT = ("int4", "nf4")  # two values a byte, one scale per group of inputs
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the 4-bit kernels take
DEFAULT_GROUP_SIZES = {"int4": 32, "nf4": 64}  # nf4: QLoRA's and bitsandbytes' default
CHOICES = "int8, w8a8, int4, int4-<group size>, nf4 or nf4-<group size>"  # what quantize= takes, for messages
W8A8 = "w8a8"  # int8 weights, and int8 activations in CPU products (kernels.linear.w8a8)


@dataclass(frozen=True)
class QuantScheme:
    """How a model's weights are quantized: ``int8``, or ``int4`` / ``nf4`` (``quant/nf4.py``) with
    ``group_size`` inputs per scale.

    ``activations="int8"`` (``quantize="w8a8"``): int8 weights as ``int8``'s, multiplied on CPU
    with the activations quantized to int8 too, row by row, at run time
    (``kernels.linear.w8a8``); the weights, and so a folder's tensors, are ``int8``'s."""

    name: str
    group_size: Optional[int] = None
    activations: Optional[str] = None

    def __post_init__(self) -> None:
        if self.name not in SCHEMES:
            raise ConfigError(f"quantize={self.name!r}: expected one of {CHOICES}")
        if self.name == "int8" and self.group_size is not None:
            raise ConfigError("int8 has one scale per output row: give no group_size")
        if self.four_bit and (type(self.group_size) is not int or self.group_size not in INT4_GROUP_SIZES):
            raise ConfigError(f"{self.name} group_size={self.group_size!r}: expected one of {INT4_GROUP_SIZES}")
        if self.activations not in (None, "int8") or (self.activations and self.name != "int8"):
            raise ConfigError(f"activations={self.activations!r}: only int8 weights take int8 activations (quantize='w8a8')")

    @classmethod
    def parse(cls, value: "str | QuantScheme | dict | None") -> Optional["QuantScheme"]:
        """``"int8"``, ``"w8a8"``, ``"int4"`` (group 32), ``"int4-128"``, ``"nf4"`` (group 64), ``"nf4-32"``,
        a dict from params.json, or None."""
        if value is None or isinstance(value, QuantScheme):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"scheme", "group_size", "activations"}
            if unknown or "scheme" not in value:
                raise ConfigError(
                    f"quantization={value!r}: expected {{'scheme': 'int8'|'int4'|'nf4', 'group_size': int, 'activations': 'int8'}}"
                )
            return cls(value["scheme"], value.get("group_size"), value.get("activations"))
        if not isinstance(value, str):
            raise ConfigError(f"quantize={value!r}: expected one of {CHOICES}")
        if value == W8A8:
            return cls("int8", activations="int8")
        name, dash, group = value.partition("-")
        if name in FOUR_BIT:
            if dash and not (group.isascii() and group.isdigit()):  # not "²" or "٣", which isdigit() takes
                raise ConfigError(f"quantize={value!r}: the group size after '{name}-' must be a number, e.g. {name}-128")
            return cls(name, int(group) if group else DEFAULT_GROUP_SIZES[name])
        if dash:
            raise ConfigError(f"quantize={value!r}: only int4 and nf4 take a group size (int4-32, nf4-128)")
        return cls(name)

    @property
    def four_bit(self) -> bool:
        """int4 or nf4: two values a byte, ``group_size`` inputs a scale."""
        return self.name in FOUR_BIT

    @property
    def label(self) -> str:
        """``int8``, ``w8a8 (int8 activations)``, ``int4 (groups of 32)``."""
        if self.activations:
            return f"{W8A8} (int8 activations)"
        return self.name if self.group_size is None else f"{self.name} (groups of {self.group_size})"

    def to_params(self) -> dict:
        params = {"scheme": self.name, "group_size": self.group_size, "activations": self.activations}
        return {key: value for key, value in params.items() if value is not None}

    def check_shape(self, name: str, shape: tuple) -> None:
        if self.group_size is not None and shape[-1] % self.group_size:
            raise ConfigError(f"{name}: {shape[-1]} inputs are not a multiple of the {self.name} group size {self.group_size}")

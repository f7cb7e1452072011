"""What every weight back-end is: an ``nn.Linear`` whose ``forward`` is its kernels' product.

A back-end (one file of ``kernels/linear/``) says

* which weights it reads (``reads``: a weight kind and the layout prepared for it), on which
  devices (``devices``) and under which tuning (``wanted``): ``takes`` asks all three;
* how it lays a weight out when it is read from disk (``prepare``: int4's kernel layout, GemLite's
  packing), and how it lays out a loaded model's weights that go together (``prepare_model``: oneDNN
  packs ``wq wk wv`` side by side);
* its product, ``product(x, weight, tuning)``, and the product of one input by several weights
  (``products``: one call where they were joined side by side at load).

``swapped_in`` makes a loaded ``nn.Linear`` the back-end's class and gives it the tuning its kernels
follow, once (``formats.modules.use_formats`` calls it); its ``forward`` then calls ``product`` with
no further choice of kernel: which back-end a weight takes is decided at load, by the table in
``kernels/linear/__init__.py``. Inside one back-end, the choices left are those of the call
(how many rows, compiled or not), e.g. int8's dequantize-then-multiply for prompts.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from mixtral_infer.fast.int4_inline import plain_values
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight
from mixtral_infer.tuning import Tuning

DEFAULT = Tuning()  # what a call that is given no tuning follows


def device_type(weight: object) -> str:
    """``"cpu"``, ``"cuda"``...: where ``weight`` (a tensor or a weight holder) lives."""
    device = getattr(weight, "device", None)
    return "cpu" if device is None else torch.device(device).type


class LinearBackend(nn.Linear):
    """One weight back-end (module docstring); subclasses fill in the class methods."""

    devices: Optional[Tuple[str, ...]] = None  # the device types its kernels run on (None: any)
    inline_int4 = False  # multiplies int4 rows with their scales inline (fast.int4_inline) by its kernels
    tuning: Tuning = DEFAULT  # set by swapped_in

    @classmethod
    def reads(cls, weight: object) -> bool:
        """Whether ``weight`` is of the kind (and prepared layout) this back-end multiplies."""
        raise NotImplementedError

    @classmethod
    def wanted(cls, tuning: Tuning) -> bool:
        """Whether ``tuning`` asks for this back-end (the fast ones: ``tuning.fast``)."""
        return tuning.fast

    @classmethod
    def takes(cls, weight: object, tuning: Tuning) -> bool:
        on_device = cls.devices is None or device_type(weight) in cls.devices
        return cls.wanted(tuning) and on_device and cls.reads(weight)

    @classmethod
    def prepare(cls, weight: object, tuning: Tuning, keep_values: bool = False) -> bool:
        """Lay out one weight as it is read (in place); True when this back-end did, and no other should."""
        return False

    @classmethod
    def prepare_model(cls, model: nn.Module, tuning: Tuning, pack: bool | str) -> None:
        """Lay out a loaded model's weights (in place), where weights go together (side by side)."""

    @staticmethod
    def product(x: torch.Tensor, weight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)``."""
        raise NotImplementedError

    @classmethod
    def products(cls, x: torch.Tensor, weights: Sequence, tuning: Tuning = DEFAULT) -> List[torch.Tensor]:
        """``[product(x, w) for w in weights]``; back-ends that join weights at load make it one call."""
        return [cls.product(x, weight, tuning) for weight in weights]

    @classmethod
    def swapped_in(cls, module: nn.Linear, tuning: Tuning) -> None:
        """Make ``module`` this back-end (its class; parameters and ``state_dict`` unchanged), following ``tuning``."""
        module.__class__ = cls
        module.tuning = tuning

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.tuning)


def laid_out_for(weight, backend: type, tuning: Tuning = DEFAULT):
    """A quantized weight in the plain layout (``QuantizedParameter``) laid out for ``backend`` as
    loading would have (its ``prepare``): a new holder where ``backend`` has a layout of its own, else
    ``weight``. For a model unpickled where the back-end it was saved with cannot run: the integer dot
    products without the native library, whose int4 rows with their scales inline (``fast.int4_inline``)
    are read back to the plain bytes, which int4's CPU kernel wants in its layout."""
    if not backend.inline_int4:
        weight = plain_again(weight)
    if not isinstance(weight, QuantizedParameter) or weight.values is None or weight.packed is not None:
        return weight
    plain = QuantizedWeight(weight.scheme, weight.values, weight.scales, weight.in_features)
    backend.prepare(plain, tuning)
    return QuantizedParameter(plain) if plain.packed is not None or plain.values is not weight.values else weight


def plain_again(weight):
    """An int4 weight holder whose rows hold their scales inline (``fast.int4_inline``, the integer dot
    products' layout) as a holder of the plain layout, read back; any other weight as it is."""
    if isinstance(weight, QuantizedParameter) and weight.values is None and weight.holds_inline_scales():
        values = plain_values(weight.packed[0], weight.in_features, weight.scheme.group_size)
        return QuantizedParameter(QuantizedWeight(weight.scheme, values, weight.scales, weight.in_features))
    return weight


def put_weight(model: nn.Module, name: str, new: nn.Module | nn.Parameter) -> None:
    """Put ``new`` (a weight holder, or a parameter again) where attribute ``name`` of ``model`` was.
    (The module holding it takes the class that reads it when the model is swapped again:
    ``formats.modules.replace_parameter`` does both.)"""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if hasattr(module, leaf):
        delattr(module, leaf)
    setattr(module, leaf, new)

"""The CPU decode step built ahead of time by AOTInductor: torch.compile's kernels, no Python per step.

A step compiled by ``torch.compile`` runs Python on every call: dynamo's frame hook and guards,
AOTAutograd's wrapper, and inductor's Python wrapper, which allocates the step's intermediate
buffers (about 200 at mistral-bench's 8 layers) and checks its inputs' sizes before it calls the
one C++ kernel the step fuses into. At the bench shapes that is 0.7-1.1 ms of a 5-10 ms step, while
the kernel itself takes about llama.cpp's whole step (``bench/step_overhead.py``; ``bench/PERFORMANCE_LOG.md``).

Here the same ``decode_one_token`` is exported (``torch.export``, non-strict: Python runs it once
on fake tensors with ``torch.compiler.is_compiling()`` true, so it takes the forms written for
compiled code) and AOTInductor builds it into a shared library whose wrapper is C++. The weights
are not copied into it: the runner is handed the model's own tensors (``user_managed``), so it reads
them where they are, and a weight edited in place is seen. A weight *replaced* (``quantize_model``,
``unpack_model``, assigning a new parameter) is not, and nothing guards against it as dynamo would:
``current()`` checks that every tensor the library reads is still the one at its place in the model,
and the step compiler builds the step anew when one is not.

Worked example: the library of an int8 model reads ``model.layers.0.attention.wq.weight.values``
(the integers) and ``model.layers.0.attention.wq.weight.scales``, and a float model's reads
``model.output.weight``. ``model.output.weight.neg_()`` changes what the next step reads, with no
build; ``model.output.weight = nn.Parameter(...)`` makes ``current()`` False, and the next
``generate`` builds the step again rather than read the old tensor (``tests/test_cpu_aot_step.py``).

AOTInductor may add constants of its own while it lowers the step: int4's product is lowered to
a call that takes the group size as a one-value tensor (``torch.tensor(32)``). They are not the
model's and, with the weights left out of the library, not in it either: the build records them
as inductor makes them (``_scalar_constants_recorded``) and hands them over with the weights.
Not every step can be handed its weights: for w8a8 weights AOTInductor makes constants of its own
from them (fbgemm's packed matrices), which are not the model's tensors, and weights in oneDNN's
layout (``pack_model``) are read by handle. Those steps stay on ``torch.compile``
(``builds_ahead_of_time``; a build that makes other constants of its own raises ``NotAheadOfTime``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from typing import Callable, Dict, Sequence, Tuple

import torch

from mixtral_infer.fast.cpu_packed import is_packed
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.quant.model import model_scheme


def builds_ahead_of_time(model: Transformer) -> bool:
    """False for w8a8 weights, whose packed matrices AOTInductor would make constants of (module
    docstring), and for weights in oneDNN's layout (``cpu_packed``), which the step reads by a
    handle, an integer the library would keep after the weight is gone: their steps go to
    ``torch.compile`` (whose guards see a new handle) without a build tried first."""
    if is_packed(model):
        return False
    scheme = model_scheme(model)
    return scheme is None or scheme.activations is None


class NotAheadOfTime(Exception):
    """This step cannot be built by AOTInductor reading the model's own tensors."""


class _StepModule(torch.nn.Module):
    """``decode_one_token`` as a module holding the model, so that export names its tensors by
    their places in the model (``model.layers.0.attention.wq.weight``)."""

    def __init__(self, model: Transformer, decode_one_token: Callable[..., Tuple[torch.Tensor, ...]]):
        super().__init__()
        self.model = model
        self.decode_one_token = decode_one_token

    def forward(self, *args):
        return self.decode_one_token(*args)


class AotStep:
    """``decode_one_token`` (a step of ``model``, ``decode_step.make_decode_step``) built by
    AOTInductor for the shapes of ``args``, its first call's arguments.

    Called as ``decode_one_token`` is: ``step(cache_k, cache_v, tokens, positions, alive, uniform,
    temperature, top_p, top_k)``; writes the cache in place, returns fresh output tensors."""

    def __init__(self, model: Transformer, decode_one_token: Callable[..., Tuple[torch.Tensor, ...]], args: Sequence):
        self.module = _StepModule(model, decode_one_token)
        # Export traces on fake tensors: plain tensors of the arguments' shapes (the caller's may be
        # inference tensors, which export may not write); empty_strided touches no memory.
        with torch.inference_mode(False), torch.no_grad():
            examples = tuple(_plain_like(arg) for arg in args)
            exported = torch.export.export(self.module, examples, strict=False)
            tensors = {**exported.state_dict, **exported.constants}
            scalars: Dict[str, torch.Tensor] = {}
            with tempfile.TemporaryDirectory() as folder, _scalar_constants_recorded(scalars):
                package = torch._inductor.aoti_compile_and_package(
                    exported,
                    package_path=os.path.join(folder, "decode_step.pt2"),
                    inductor_configs={"aot_inductor.package_constants_in_so": False},
                )
                self.runner = torch._inductor.aoti_load_package(package)
        names = self.runner.get_constant_fqns()
        own = [name for name in names if name not in tensors and name not in scalars]
        if own:
            raise NotAheadOfTime(f"AOTInductor made {len(own)} constants of its own ({own[0]}, ...)")
        self.constants: Dict[str, torch.Tensor] = {name: tensors[name] for name in names if name in tensors}
        self.scalars = {name: scalars[name] for name in names if name not in tensors}  # inductor's (module docstring)
        self.runner.load_constants({**self.constants, **self.scalars}, check_full_update=True, user_managed=True)

    def current(self) -> bool:
        """Whether every tensor the library reads is still the model's tensor at its place."""
        return all(_at(self.module, name) is tensor for name, tensor in self.constants.items())

    def __call__(self, *args):
        return self.runner(*args)  # what decode_one_token returns: a tuple of tensors, or one


@contextlib.contextmanager
def _scalar_constants_recorded(into: Dict[str, torch.Tensor]):
    """Within the block, every one-value constant inductor adds to a graph it lowers is recorded in
    ``into`` by its name there (module docstring). Larger ones are not: they would be copies of
    weights, which the build then refuses (``NotAheadOfTime``)."""
    from torch._inductor.graph import GraphLowering

    add_tensor_constant = GraphLowering.add_tensor_constant

    def recording(graph, data, name=None):
        box = add_tensor_constant(graph, data, name)
        if data.numel() == 1:
            into[box.get_name()] = graph.constants[box.get_name()]
        return box

    GraphLowering.add_tensor_constant = recording
    try:
        yield
    finally:
        GraphLowering.add_tensor_constant = add_tensor_constant


def _plain_like(arg):
    if not isinstance(arg, torch.Tensor):
        return arg
    return torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype, device=arg.device)


def _at(module: torch.nn.Module, name: str):
    """The object at a dotted place (``model.layers.0.attention.wq.weight``), None if there is none."""
    try:
        return functools.reduce(getattr, name.split("."), module)
    except AttributeError:
        return None

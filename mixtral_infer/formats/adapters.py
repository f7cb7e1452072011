"""LoRA adapters kept beside the weights, several at once, each token reading its own.

Merged (``checkpoint.lora.merged``), an adapter changes the weights, so a model runs one adapter. Kept
apart, a projection ``W`` (out, in) serves n adapters at once: the base product ``x @ W.T`` once for
every token, then each token's low-rank update ``scale * (x @ A.T) @ B.T`` from its own adapter. The
module doing it (``AdaptedLinear``) wraps the projection, so the model still calls ``self.wq(x)``;
which adapter each token reads is set on the model for one pass (``AdapterSelection``): ``ids`` (N,)
long, 0 for the base model alone, i for the i-th adapter (the serving engine sets it per step from its
rows' requests, ``serve.engine``; the fixed-shape steps derive it from an input, ``steps.compiler``).

The adapters of one projection are stacked, rank padded with zero rows to the largest (a zero row adds
nothing), the scale folded into B, slot 0 all zeros (the base model)::

    a: (n + 1, r, in)    b: (n + 1, r, out)    b[i] = (scale_i * B_i).T

Two ways to compute the update, both of fixed shapes, the same numbers (``lora_update``):

* **gathered by token** (Punica's BGMV): each token reads its adapter's ``a[ids]`` and ``b[ids]``, two
  batched products of rank r. Reads ``N * r * (in + out)`` numbers: for few tokens (decoding).
* **every adapter, masked** (one product per factor, as S-LoRA's segments do for many tokens): ``x``
  times every adapter's A at once, ``(N, n * r)``, the columns of other adapters zeroed, then times
  every adapter's B. Reads ``n * r * (in + out)``: for many tokens (prompts).

The gathered way is taken where ``N <= n``: it reads fewer numbers. Worked example, ``in = out = 2``,
rank 1, two adapters::

    a[1] = [[1, 0]], b[1] = [[0, 2]]    (adapter 1: out[1] += 2 * x[0])
    a[2] = [[0, 1]], b[2] = [[1, 0]]    (adapter 2: out[0] += x[1])
    x = [[3, 4], [3, 4], [3, 4]], ids = [0, 1, 2]  ->  update [[0, 0], [0, 6], [4, 0]]

(tests/test_lora_serving.py runs it both ways.)

The factors are kept in the model's dtype, except on a CPU that multiplies that dtype more slowly than
float32 (``Tuning.upcast``, measured once per machine, ``fast.cpu_upcast``): there they are kept in
float32 and the update is computed in float32, then rounded to the model's dtype. The update's
products are small (rank r), so their time is arithmetic, never reading the factors; float32
factors cost twice the memory of 16-bit ones (``adapter_bytes`` counts what is held).
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from mixtral_infer.tuning import Tuning

Factors = Tuple[torch.Tensor, torch.Tensor, float]  # (B (out, r), A (r, in), scale) of one adapter's update


class AdapterSelection:
    """Which adapter each token of the next pass reads: ``ids`` (N,) long, or None (the base model).
    One object for a model, shared by its ``AdaptedLinear`` modules."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)  # adapter i + 1's name
        self.ids: Optional[torch.Tensor] = None


def lora_update(x: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each token's low-rank update (module docstring): x ``(N, in)``, ids ``(N,)`` in ``[0, n]``,
    a ``(n + 1, r, in)``, b ``(n + 1, r, out)``, slot 0 zeros: ``(N, out)``."""
    adapters, rank = a.shape[0] - 1, a.shape[1]
    if x.shape[0] <= adapters:  # gathered by token: (N, r, in) and (N, r, out) read
        h = torch.bmm(a[ids], x.unsqueeze(-1))  # (N, r, 1)
        return torch.bmm(h.transpose(1, 2), b[ids]).squeeze(1)  # (N, out)
    h = x @ a[1:].reshape(adapters * rank, -1).T  # (N, n * r): every adapter's down-projection
    owner = torch.arange(1, adapters + 1, device=x.device).repeat_interleave(rank)  # (n * r,) each column's adapter
    h = torch.where(ids[:, None] == owner[None, :], h, torch.zeros((), dtype=h.dtype, device=h.device))
    return h @ b[1:].reshape(adapters * rank, -1)  # (N, out)


class AdaptedLinear(nn.Module):
    """A projection with adapters kept apart: ``base(x)`` plus each token's update (module docstring).
    ``weight`` is the base's, so code that reads a projection's shape or dtype reads it unchanged."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, selection: AdapterSelection):
        super().__init__()
        self.base = base
        self.register_buffer("a", a, persistent=False)  # (n + 1, r, in)
        self.register_buffer("b", b, persistent=False)  # (n + 1, r, out)
        self.selection = selection

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def update(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The selected adapters' update of ``x (N, in)``, ``(N, out)``; None when none is selected."""
        ids = self.selection.ids
        if ids is None:
            return None
        return lora_update(x.to(self.a.dtype), ids, self.a, self.b).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_update(self, x, self.base(x))


def unadapted(module: nn.Module) -> nn.Module:
    """The projection under an ``AdaptedLinear``, or ``module`` itself."""
    return module.base if isinstance(module, AdaptedLinear) else module


def with_update(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (the base product of ``x``) plus ``module``'s adapters' update where it has adapters."""
    update = module.update(x) if isinstance(module, AdaptedLinear) else None
    return out if update is None else out + update


def stacked(updates: Sequence[Optional[Factors]], out_features: int, in_features: int,
            dtype: torch.dtype, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One projection's adapters (None: an adapter that leaves it alone) as ``a (n + 1, r, in)`` and
    ``b (n + 1, r, out)``: slot 0 and the rows past an adapter's rank zeros, the scale in b."""
    rank = max(a.shape[0] for _, a, _ in (u for u in updates if u is not None))
    a_all = torch.zeros(len(updates) + 1, rank, in_features, dtype=torch.float32)
    b_all = torch.zeros(len(updates) + 1, rank, out_features, dtype=torch.float32)
    for slot, update in enumerate(updates, start=1):
        if update is not None:
            b, a, scale = update
            a_all[slot, : a.shape[0]] = a.float()
            b_all[slot, : a.shape[0]] = (b.float() * scale).T
    return a_all.to(device=device, dtype=dtype), b_all.to(device=device, dtype=dtype)


def factor_dtype(dtype: torch.dtype, device: torch.device, tuning: Tuning) -> torch.dtype:
    """The dtype adapters' factors are kept and multiplied in beside weights of ``dtype``: float32 on a
    CPU whose tuning widens ``dtype``'s products (module docstring), else ``dtype``."""
    return torch.float32 if device.type == "cpu" and dtype in tuning.upcast else dtype


def attach_adapters(model: nn.Module, names: Sequence[str], adapters: Sequence[Dict[str, Factors]]) -> AdapterSelection:
    """Wrap each projection some adapter updates in an ``AdaptedLinear`` holding every adapter's
    factors (``adapters[i]``: published weight name -> factors), in ``factor_dtype``; the selection
    the modules share, kept on the model as ``model.adapters``. Names and shapes are the caller's to
    check (``checkpoint.lora.open_adapter``); a target that is not a projection here is refused."""
    if getattr(model, "adapters", None) is not None:
        raise ValueError("this model already has adapters attached")
    selection = AdapterSelection(names)
    tuning = getattr(model, "tuning", None) or Tuning.default()  # use_formats' (formats.modules.tuning_of)
    dtype = factor_dtype(model.dtype, next(model.parameters()).device, tuning)
    targets = sorted({name for adapter in adapters for name in adapter})
    for name in targets:
        path = name.removesuffix(".weight")
        base = model.get_submodule(path)
        weight = base.weight
        out_features, in_features = base.out_features, base.in_features
        a, b = stacked([adapter.get(name) for adapter in adapters], out_features, in_features, dtype, weight.device)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, AdaptedLinear(base, a, b, selection))
    model.adapters = selection
    return selection


def adapted_modules(model: nn.Module) -> Iterator[AdaptedLinear]:
    return (module for module in model.modules() if isinstance(module, AdaptedLinear))


class selected:
    """``with selected(model, ids):`` the pass inside reads adapter ``ids[t]`` for token t (None: none).
    Written as assignments, not a generator, so that torch.compile traces it in a step."""

    def __init__(self, model: nn.Module, ids: Optional[torch.Tensor]):
        self.selection: Optional[AdapterSelection] = getattr(model, "adapters", None)
        self.ids = ids

    def __enter__(self) -> None:
        if self.selection is not None:
            self.selection.ids = self.ids

    def __exit__(self, *exc) -> None:
        if self.selection is not None:
            self.selection.ids = None


def adapter_bytes(model: nn.Module) -> int:
    """The bytes the adapters kept apart hold beside ``model``'s weights (their stacked factors)."""
    return sum(t.numel() * t.element_size() for module in adapted_modules(model) for t in (module.a, module.b))

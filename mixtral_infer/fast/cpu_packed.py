"""bfloat16 weights in oneDNN's blocked layout, which CPU matmuls read faster.

``F.linear`` on a bfloat16 CPU tensor calls oneDNN, which first reorders the plain
``(OUT, IN)`` weight into its blocked layout on every call. Reordering each weight once,
at load, and calling the same oneDNN product on the result (``torch.ops.mkldnn``'s
``_reorder_linear_weight`` and ``_linear_pointwise``, what ``torch.compile``'s CPU
backend does to frozen weights) gives the same numbers, bit for bit, faster: the layout,
not the op, is the gain. float16 is not packed by ``pack_model``: there the blocked layout
is slower for one row, and one row is what decoding a single sequence multiplies. ``pack``
itself takes either type, where this CPU's oneDNN can reorder it (``onednn_packs``).

A packed weight is opaque (a ``torch._mkldnn`` tensor), so it lives in a ``PackedWeight``
that ``linear()`` recognises, in place of the ``nn.Parameter`` (``pack_model``):
``weight[e]`` is expert ``e`` of stacked experts, ``weight.dense()`` the plain tensor
(the readable reference, and what ``state_dict()`` holds under the parameter's name).
``unpack_model`` puts plain parameters back, for code that edits weights. ``load_model``
packs the bfloat16 models it loads on CPU unless ``pack=False``.

Weights that multiply the same input are packed side by side, as gpt-fast fuses ``wqkv``:
``wq wk wv`` as one matrix, ``w1 w3`` as one (per expert). Each keeps its own name and
shape, as a block of rows (``PackedWeight.rows``), and ``kernels.linear.linears`` multiplies
the blocks of one matrix in one call: few-row products of small matrices read them slower,
and each call has a cost of its own.

``torch.compile`` cannot trace the opaque tensors, so compiled code (the static decode
step) reaches them through a custom op, ``mixtral_infer::packed_linear(x, handle, expert)``:
the matrices sit in a table under an integer ``handle`` that the graph holds as a constant,
and the op, opaque to the compiler, multiplies by ``table[handle][expert]``. A compiled step
then reads the weights in the blocked layout and fuses everything between the matmuls.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Callable, Collection, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

PACKED_DTYPES = (torch.bfloat16,)  # what pack_model packs (module docstring: float16 is slower packed)

_MATRICES: Dict[int, List] = {}  # handle -> packed matrices, one per expert
_MULTIPLY: Dict[int, Callable] = {}  # handle -> multiply(x, matrix): the library call that reads them
_handles = itertools.count()


def onednn_linear(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ matrix.T`` by oneDNN: ``matrix`` packed in its layout, or a plain tensor (``fast.cpu_float32``)."""
    return torch.ops.mkldnn._linear_pointwise(x, matrix, None, "none", [], "")


def _onednn_plain(matrix: torch.Tensor) -> torch.Tensor:
    return matrix.to_dense()


class _Matrices:
    """Owns one table entry: it leaves the table when no PackedWeight refers to it any more.

    ``multiply(x, matrix)`` and ``plain(matrix)`` (the ``(OUT, IN)`` tensor it was packed from) say
    which library's layout the matrices are in: oneDNN's (this module) or another CPU library's
    (``kernels.linear.w8a8`` packs int8 weights for fbgemm the same way)."""

    def __init__(
        self, matrices: List, out_features: int, multiply: Callable = onednn_linear, plain: Callable = _onednn_plain
    ):
        self.handle = next(_handles)
        self.out_features = out_features  # of each matrix: the rows of all the weights packed side by side
        self.plain = plain
        _MATRICES[self.handle], _MULTIPLY[self.handle] = matrices, multiply
        weakref.finalize(self, _forget, self.handle)

    def __deepcopy__(self, memo) -> "_Matrices":
        return self  # packed matrices are never written: a copied model shares them


def _forget(handle: int) -> None:
    _MATRICES.pop(handle, None)
    _MULTIPLY.pop(handle, None)


def _matrix(handle: int, expert) -> torch.Tensor:
    """The packed matrix of table entry ``handle``: its only one, or expert ``expert``'s (int or 0-d tensor)."""
    return _MATRICES[handle][0 if expert is None else int(expert)]


class PackedWeight:
    """A weight ``(..., OUT, IN)`` held as one oneDNN-layout matrix per leading index (expert).

    ``expert``: for one expert of stacked weights, its index (an int, or a 0-d tensor in
    compiled code, which the op reads). ``rows``: ``(start, stop)`` where the weight is a block
    of rows of matrices packed side by side (``pack_model``), else None."""

    def __init__(self, owner: _Matrices, shape: torch.Size, dtype: torch.dtype, expert=None, rows=None):
        self.owner, self.shape, self.dtype, self.expert, self.rows = owner, torch.Size(shape), dtype, expert, rows
        self.handle = owner.handle  # what compiled code passes to the op: a constant of the graph

    @property
    def matrices(self) -> List[torch.Tensor]:
        return _MATRICES[self.handle] if self.expert is None else [_matrix(self.handle, self.expert)]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def __getitem__(self, index) -> "PackedWeight":
        """Expert ``index`` (an int, or a 0-d tensor: read on the host, free on CPU, except in
        compiled code, where the op reads it) of stacked weights."""
        if len(self.shape) != 3 or self.expert is not None:
            raise IndexError(f"a packed {tuple(self.shape)} weight is one matrix; only stacked experts are indexed")
        if not torch.compiler.is_compiling():
            index = int(index)
        return PackedWeight(self.owner, self.shape[1:], self.dtype, index, self.rows)

    def whole(self) -> "PackedWeight":
        """The matrices this weight is a block of rows of (itself when it is all of them)."""
        if self.rows is None:
            return self
        shape = (*self.shape[:-2], self.owner.out_features, self.shape[-1])
        return PackedWeight(self.owner, shape, self.dtype, self.expert)

    def numel(self) -> int:
        return self.shape.numel()

    def dense(self) -> torch.Tensor:
        """The plain weight ``(..., OUT, IN)``."""
        plain = [self.owner.plain(matrix) for matrix in self.matrices]
        if self.rows is not None:
            plain = [matrix[self.rows[0] : self.rows[1]].contiguous() for matrix in plain]
        return torch.stack(plain) if len(self.shape) == 3 else plain[0]


def can_pack(tensor: torch.Tensor, dtypes: Collection[torch.dtype] = PACKED_DTYPES) -> bool:
    """Whether ``pack_model`` packs ``tensor``: a CPU matrix (or stacked experts) of one of ``dtypes``
    that this CPU's oneDNN reorders."""
    return (
        tensor.device.type == "cpu"
        and tensor.dtype in dtypes
        and tensor.dim() in (2, 3)
        and onednn_packs(tensor.dtype)
    )


@functools.lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN reorders ``dtype`` weights: bfloat16 needs AVX-512, float16
    ``avx512_fp16`` or ``avx_ne_convert`` (a CPU with avx512_bf16 but neither of those packs
    bfloat16 only). Asked of oneDNN itself, by reordering a small matrix."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def pack(tensor: torch.Tensor) -> PackedWeight:
    """``tensor`` (OUT, IN) or stacked experts (E, OUT, IN), reordered once for few-row products."""
    if not onednn_packs(tensor.dtype):
        raise ValueError(f"oneDNN cannot pack {tensor.dtype} weights on this CPU: keep them plain (load_model(..., pack=False))")
    return _pack_matrices([tensor] if tensor.dim() == 2 else list(tensor.unbind(0)), tensor.shape, tensor.dtype)


def _pack_matrices(matrices, shape: torch.Size, dtype: torch.dtype) -> PackedWeight:
    """One oneDNN matrix per item of ``matrices`` (an iterable of (OUT, IN) tensors, read one by one)."""
    packed = [torch.ops.mkldnn._reorder_linear_weight(matrix.contiguous(), 1) for matrix in matrices]
    return PackedWeight(_Matrices(packed, shape[-2]), shape, dtype)


def pack_side_by_side(tensors: Sequence[torch.Tensor]) -> List[PackedWeight]:
    """Weights that multiply the same input (``(OUT_i, IN)``, or stacked ``(E, OUT_i, IN)``), packed
    as one matrix of their rows stacked: ``linears`` then multiplies them in one product.
    Example: wq (1024, 1024), wk and wv (256, 1024) -> one (1536, 1024) matrix, blocks of rows
    [0, 1024), [1024, 1280), [1280, 1536)."""
    first = tensors[0]
    shape = torch.Size((*first.shape[:-2], sum(t.shape[-2] for t in tensors), first.shape[-1]))
    if first.dim() == 2:
        whole = _pack_matrices([torch.cat(list(tensors))], shape, first.dtype)
    else:  # expert by expert: one expert's rows are copied at a time, not all of them
        joined = (torch.cat([t[e] for t in tensors]) for e in range(first.shape[0]))
        whole = _pack_matrices(joined, shape, first.dtype)
    blocks, start = [], 0
    for tensor in tensors:
        stop = start + tensor.shape[-2]
        blocks.append(PackedWeight(whole.owner, tensor.shape, tensor.dtype, rows=(start, stop)))
        start = stop
    return blocks


def side_by_side(weights: Sequence) -> Optional[PackedWeight]:
    """The one packed weight that ``weights`` are, in order, the blocks of rows of (same matrices,
    same expert), or None: then ``linears`` multiplies them one by one."""
    first = weights[0]
    if not all(isinstance(w, PackedWeight) and w.rows is not None and w.owner is first.owner for w in weights):
        return None
    if not all(w.expert is first.expert or (isinstance(w.expert, int) and w.expert == first.expert) for w in weights):
        return None
    bounds = [0] + [w.rows[1] for w in weights]
    if any(w.rows[0] != start for w, start in zip(weights, bounds)) or bounds[-1] != first.owner.out_features:
        return None
    return first.whole()


# Declared with torch.library.Library rather than the custom_op decorator: the dispatcher calls
# the function directly, several times cheaper a call (dozens of calls a decoding step).
_LIBRARY = torch.library.Library("mixtral_infer", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, int handle, Tensor? expert, int out_features) -> Tensor")


def _packed_linear_op(x: torch.Tensor, handle: int, expert: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``packed_linear`` as compiled code calls it: the weight by its handle (and expert)."""
    return _MULTIPLY[handle](x, _matrix(handle, expert))


_LIBRARY.impl("packed_linear", _packed_linear_op, "CPU")


@torch.library.register_fake("mixtral_infer::packed_linear")
def _(x: torch.Tensor, handle: int, expert: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def packed_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x (..., IN) @ weight (OUT, IN).T`` -> ``(..., OUT)``, equal to ``F.linear(x, weight.dense())``."""
    if len(weight.shape) != 2:
        raise ValueError(f"a stacked {tuple(weight.shape)} weight: multiply by one expert, weight[e]")
    if torch.compiler.is_compiling():
        expert = weight.expert
        if isinstance(expert, int):
            expert = torch.tensor(expert)
        out = torch.ops.mixtral_infer.packed_linear(x, weight.handle, expert, weight.owner.out_features)
    else:
        out = _packed_linear_op(x, weight.handle, weight.expert, weight.owner.out_features)
    # A block of rows packed with others: their product too, of which its columns (linears takes them all at once)
    return out if weight.rows is None else out[..., weight.rows[0] : weight.rows[1]]


class PackedParameter(nn.Module, PackedWeight):
    """A ``PackedWeight`` held by a model in place of an ``nn.Parameter``. ``state_dict()`` gives
    the plain weight under the parameter's own name; ``model.to(...)`` does not move it."""

    def __init__(self, weight: PackedWeight):
        nn.Module.__init__(self)
        PackedWeight.__init__(self, weight.owner, weight.shape, weight.dtype, weight.expert, weight.rows)
        self._register_state_dict_hook(_plain_in_state_dict)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, dtype={self.dtype}, oneDNN layout"


def _plain_in_state_dict(module: PackedParameter, state_dict: dict, prefix: str, local_metadata) -> None:
    state_dict[prefix[:-1]] = module.dense()  # prefix is "layers.0.attention.wq.weight."


def side_by_side_groups(names: Iterable[str], shape: Callable[[str], torch.Size]) -> List[List[str]]:
    """``names`` of weights to pack, in the groups to pack together: the members of a ``SIDE_BY_SIDE``
    group found among them, if their dimensions other than OUT agree (``shape(name)``), else each alone.
    Example: layer 0's wq, wk, wv and wo -> ``[[wq, wk, wv], [wo]]``."""
    left, groups = set(names), []
    for name in sorted(left):
        if name not in left:  # in the group of an earlier one
            continue
        group = [n for n in _side_by_side_names(name) if n in left]
        if len(group) < 2 or len({(shape(n)[:-2], shape(n)[-1]) for n in group}) > 1:
            group = [name]
        groups.append(group)
        left.difference_update(group)
    return groups


SIDE_BY_SIDE = (("wq", "wk", "wv"), ("w1", "w3"))  # weights that multiply the same input (pack_model)


def _side_by_side_names(name: str) -> List[str]:
    """``layers.0.attention.wk.weight`` -> the names of wq, wk, wv in that module; [name] if it has no group."""
    parts = name.split(".")
    for group in SIDE_BY_SIDE:
        for i, part in enumerate(parts):
            if part in group:
                return [".".join([*parts[:i], member, *parts[i + 1 :]]) for member in group]
    return [name]

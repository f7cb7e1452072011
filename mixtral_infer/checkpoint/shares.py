"""Which part of each published tensor a rank of a parallel group reads: the shares of
``model.parallel.Parallel`` in the checkpoint's names and layouts (its docstring has the example)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from mixtral_infer.model.parallel import Parallel

LAYER_TENSOR = re.compile(r"^layers\.(\d+)\.(.+)$")  # a published tensor of layer i: (i, the rest)
_EXPERT = re.compile(r"^feed_forward\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Selection:
    """Which part of a published tensor one rank keeps."""

    rows: Optional[slice] = None  # keep these rows (read as one byte range)
    columns: Optional[slice] = None  # then keep these columns


def select_share(parallel: Parallel, name: str, args) -> Optional[Selection]:
    """The part of published tensor ``name`` this rank keeps; None when it keeps nothing."""
    if name == "tok_embeddings.weight":
        return Selection() if parallel.is_first_stage else None
    if name in ("norm.weight", "output.weight"):
        return Selection() if parallel.is_last_stage else None
    match = LAYER_TENSOR.match(name)
    if match is None:
        return Selection()  # not ours to judge: the loader reports it as unexpected
    if int(match[1]) not in parallel.layer_range(args.n_layers):
        return None
    if parallel.tensor_parallel == 1:
        return Selection()
    rest = match[2]
    expert = _EXPERT.match(rest)
    if expert is not None:
        return Selection() if int(expert[1]) in parallel.share(args.moe.num_experts if args.moe else 0) else None
    heads = _as_slice(parallel.share(args.n_heads), args.head_dim)
    kv_heads = _as_slice(parallel.share(args.n_kv_heads), args.head_dim)
    hidden = _as_slice(parallel.share(args.hidden_dim), 1)
    return {
        "attention.wq.weight": Selection(rows=heads),
        "attention.wk.weight": Selection(rows=kv_heads),
        "attention.wv.weight": Selection(rows=kv_heads),
        "attention.wo.weight": Selection(columns=heads),
        "feed_forward.w1.weight": Selection(rows=hidden),
        "feed_forward.w3.weight": Selection(rows=hidden),
        "feed_forward.w2.weight": Selection(columns=hidden),
    }.get(rest, Selection())


def _as_slice(units: range, width: int) -> slice:
    return slice(units.start * width, units.stop * width)

"""The network: a decoder of attention and feed-forward blocks, its cache, and its parts.

``transformer`` (ModelArgs, Transformer, Attention) is the model in one file; it is built from
``attention`` (GQA over the rotating cache), ``cache`` (the rotating buffer and its per-chunk
metadata), ``xformers_bias`` (the masks), ``rope``, ``moe`` (top-k experts), ``linear`` (the one
matmul every weight goes through) and ``parallel`` (which share of each weight a rank holds).
Nothing here reads files: loading lives in ``mixtral_infer.checkpoint``.

Its names are imported when first used (``__getattr__``): ``fast`` modules that the model's
parts use import ``model.xformers_bias``, which would otherwise import the whole model first.
"""

import importlib

_HOMES = {"ModelArgs": "transformer", "Transformer": "transformer", "MoeArgs": "moe", "MoeLayer": "moe"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

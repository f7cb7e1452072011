"""The network: a decoder of attention and feed-forward blocks, its cache, and its parts.

``transformer`` (ModelArgs, Transformer, Attention) is the model in one file; it is built from
``attention`` (GQA over the rotating cache), ``cache`` (the rotating buffer and its per-chunk
metadata), ``xformers_bias`` (the masks), ``rope``, ``moe`` (top-k experts), ``linear`` (the one
matmul every weight goes through) and ``parallel`` (which share of each weight a rank holds).
Nothing here reads files: loading lives in ``mixtral_infer.checkpoint``.
"""

from mixtral_infer.model.moe import MoeArgs, MoeLayer
from mixtral_infer.model.transformer import ModelArgs, Transformer

__all__ = ["ModelArgs", "MoeArgs", "MoeLayer", "Transformer"]

"""The reference model: a decoder of attention and feed-forward blocks, its cache, and its parts.

``transformer`` (ModelArgs, Transformer, Attention) is built from ``attention`` (GQA over the
rotating cache), ``cache`` (the rotating buffer and its per-chunk metadata), ``xformers_bias``
(the masks), ``rope``, ``moe`` (top-k experts) and ``parallel`` (which share of the model a rank
holds). It imports torch, the xformers bias classes and the package's errors only: reading files
lives in ``mixtral_infer.checkpoint``, the fast modules swapped in after loading in ``mixtral_infer.fast``.
"""

from mixtral_infer.model.moe import MoeArgs, MoeLayer
from mixtral_infer.model.transformer import ModelArgs, Transformer

__all__ = ["ModelArgs", "MoeArgs", "MoeLayer", "Transformer"]

"""Generation: prompts in, tokens out.

``generate`` (prefill in chunks, then decode), ``sampling`` (temperature, top-p, top-k on the
device), ``settings`` (checks every setting before any heavy work) and ``chat`` (the instruct
format and a conversation's state). The static-shaped CUDA decode step is in ``mixtral_infer.fast``.
"""

from mixtral_infer.generation.generate import generate

__all__ = ["generate"]

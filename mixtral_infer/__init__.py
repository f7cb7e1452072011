"""mixtral_infer: a readable reference implementation of Mistral 7B and Mixtral 8x7B inference.

The public API is importable from here (``from mixtral_infer import load_model``). Each name is
imported on first use, so ``import mixtral_infer`` (and the command line's ``--help``) does
not pay for torch and xformers until a model is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mixtral_infer._version import __version__
from mixtral_infer.errors import CheckpointError, ConfigError, GenerationError, MixtralInferError

_LAZY = {  # name -> the module that defines it
    "LLM": "mixtral_infer.llm",
    "SamplingParams": "mixtral_infer.generation.sampling_params",
    "Completion": "mixtral_infer.llm",
    "Conversation": "mixtral_infer.generation.chat",
    "perplexity": "mixtral_infer.generation.perplexity",
    "save_model": "mixtral_infer.checkpoint.loading",
    "load_model": "mixtral_infer.checkpoint.loading",
    "generate": "mixtral_infer.generation.generate",
    "forward": "mixtral_infer.generation.settings",
    "Tuning": "mixtral_infer.tuning",
    "CacheView": "mixtral_infer.model.cache",
    "RotatingBufferCache": "mixtral_infer.model.cache",
    "RotatingCacheInputMetadata": "mixtral_infer.model.cache",
    "interleave_list": "mixtral_infer.model.cache",
    "unrotate": "mixtral_infer.model.cache",
    "MoeArgs": "mixtral_infer.model.moe",
    "MoeLayer": "mixtral_infer.model.moe",
    "ModelArgs": "mixtral_infer.model.transformer",
    "Transformer": "mixtral_infer.model.transformer",
    "Tokenizer": "mixtral_infer.tokenizer",
}

if TYPE_CHECKING:  # what type checkers and editors see
    from mixtral_infer.checkpoint.loading import load_model, save_model
    from mixtral_infer.generation.chat import Conversation
    from mixtral_infer.generation.perplexity import perplexity
    from mixtral_infer.generation.sampling_params import SamplingParams
    from mixtral_infer.llm import LLM, Completion
    from mixtral_infer.generation.generate import generate
    from mixtral_infer.generation.settings import forward
    from mixtral_infer.model.cache import (
        CacheView,
        RotatingBufferCache,
        RotatingCacheInputMetadata,
        interleave_list,
        unrotate,
    )
    from mixtral_infer.model.moe import MoeArgs, MoeLayer
    from mixtral_infer.model.transformer import ModelArgs, Transformer
    from mixtral_infer.tokenizer import Tokenizer
    from mixtral_infer.tuning import Tuning


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mixtral_infer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__():
    return sorted(__all__)


__all__ = sorted(
    ["CheckpointError", "ConfigError", "GenerationError", "MixtralInferError", "__version__", *_LAZY]
)

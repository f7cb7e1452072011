"""mixtral_infer: a readable reference implementation of Mistral 7B and Mixtral 8x7B inference."""

from mixtral_infer._version import __version__
from mixtral_infer.checkpoint import load_model
from mixtral_infer.errors import CheckpointError, ConfigError, GenerationError, MixtralInferError
from mixtral_infer.generation.generate import generate
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

__all__ = [
    "CacheView",
    "CheckpointError",
    "ConfigError",
    "GenerationError",
    "MixtralInferError",
    "ModelArgs",
    "MoeArgs",
    "MoeLayer",
    "RotatingBufferCache",
    "RotatingCacheInputMetadata",
    "Tokenizer",
    "Transformer",
    "generate",
    "load_model",
    "interleave_list",
    "unrotate",
    "__version__",
]

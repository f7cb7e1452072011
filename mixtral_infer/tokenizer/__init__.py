"""Tokenizers: one interface, ``Tokenizer``, over the three kinds of file Mistral models ship.

=====================================  ==========================================  ==============================
file                                   back-end (module)                           models
=====================================  ==========================================  ==============================
``tokenizer.model``, ``.model.v3``     sentencepiece (``sentencepiece_tokenizer``)  Mistral 7B, Mixtral 8x7B/8x22B
``tekken.json``                        mistral-common's tekken (``tekken_tokenizer``)  Nemo 12B, Ministral 8B, Small 3
``tokenizer.json``                     Hugging Face tokenizers (``json_tokenizer``)  hub folders of tekken models
=====================================  ==========================================  ==============================

``Tokenizer(path)`` opens a file with its back-end, ``Tokenizer.from_folder(folder)`` the first
of ``TOKENIZER_FILES`` in a folder (``find_tokenizer``); ``base`` lists the methods they share.
"""

from mixtral_infer.tokenizer.base import (
    BEGIN_INST,
    END_INST,
    IM_END,
    IM_START,
    LONE_SURROGATE,
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
    Tokenizer,
    find_tokenizer,
    token_list,
)
from mixtral_infer.tokenizer.json_tokenizer import JsonTokenizer
from mixtral_infer.tokenizer.sentencepiece_tokenizer import ADDED_TOKEN_FILES, AddedToken, SentencePieceTokenizer, read_added_tokens
from mixtral_infer.tokenizer.tekken_tokenizer import TekkenTokenizer

__all__ = [
    "ADDED_TOKEN_FILES",
    "AddedToken",
    "JsonTokenizer",
    "SentencePieceTokenizer",
    "TekkenTokenizer",
    "BEGIN_INST",
    "END_INST",
    "IM_END",
    "IM_START",
    "LONE_SURROGATE",
    "SPECIAL_TOKENS_MAP",
    "TOKENIZER_CONFIG",
    "TOKENIZER_FILES",
    "Tokenizer",
    "find_tokenizer",
    "read_added_tokens",
    "token_list",
]

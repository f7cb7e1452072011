"""Checkpoints and their formats: from files to a model, and from a model back to files.

``loading`` reads a Mistral (``params.json`` + consolidated weights) or Hugging Face folder into a
``Transformer``; ``safetensors_reader`` / ``safetensors_writer`` the file format; ``hf_format`` the
transformers names and config; ``weight_shapes`` the shape every tensor must have; ``convert``
the ``convert`` command; ``hf_tokenizer`` the tokenizer files transformers reads.
"""

from mixtral_infer.checkpoint.loading import load_model, open_checkpoint

__all__ = ["load_model", "open_checkpoint"]

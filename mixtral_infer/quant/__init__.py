"""Quantized weights (int8, int4, nf4, w8a8) as data: the scheme, ``QuantizedWeight`` and quantizing,
nf4's codes, layouts and bitsandbytes' library, and the checkpoint-facing names and checks
(``model``). The back-ends that multiply them are in ``kernels.linear`` (``int8``, ``int4``, ``nf4``,
``w8a8``, ``gemlite``, ``triton``), one file each."""

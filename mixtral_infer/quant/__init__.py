"""Quantized weights (int8, int4, nf4, w8a8): the scheme, ``QuantizedWeight`` and quantizing,
nf4's codes and layouts, the checkpoint-facing names and checks (``model``), and, until they move to
``kernels.linear``, the kernels that multiply them (``kernels``, ``int8_activations``, ``gemlite_cuda``)."""

"""Weight-only quantization (int8, int4): the weight format, its kernels, quantizing a model."""

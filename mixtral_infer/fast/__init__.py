"""The fast paths for CUDA: a static, compilable decode step and its loop; prefill on torch's
ragged flash attention. Each piece equals the readable path it replaces (tests run on CPU)."""

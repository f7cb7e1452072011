"""Compiled decoding steps: fixed-shape passes of the model that ``torch.compile`` (or, on CPU,
AOTInductor) builds once per shape, and the loop that drives them."""

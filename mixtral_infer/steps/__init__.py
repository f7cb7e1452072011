"""Fixed-shape steps of the model, and the one compiler that builds them.

* ``decode_step``: one token a row over the rotating cache, in place, the next token sampled on the
  device (``make_decode_step``) or its logits (``decode_logits``); the block pass every step shares;
* ``mixed_step``: a chunk of prompt tokens a row beside the decoding rows (the serving engine's);
* ``compiler``: builds, keeps and calls a step of each kind for ``generate`` and the serving engine
  (torch.compile, a CUDA graph on CUDA, AOTInductor on CPU), with one fall-back path;
* ``cpu_aot_step``: the CPU step built ahead of time by AOTInductor and kept on disk;
* ``decode_loop``: ``generate``'s loop around the decode step, launching a step before reading the last.
"""

"""Generation: prompts in, tokens out.

``generate`` (prefill in chunks, then decode eagerly or through ``mixtral_infer.steps``),
``settings`` (checks every setting before any heavy work, and ``forward``, the model's forward
with its inputs checked), ``chat`` (the instruct format and a conversation's state) and
``perplexity`` (a text's, its segments scored as prompts). Sampling is ``mixtral_infer.sampling``.
"""

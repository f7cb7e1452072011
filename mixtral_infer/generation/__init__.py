"""Generation: prompts in, tokens out.

``generate`` (prefill in chunks, then decode eagerly or through ``mixtral_infer.steps``),
``sampling_params`` (``SamplingParams``: how to choose tokens, one object from the front doors to
the steps, with its check), ``settings`` (checks of prompts and caches before any heavy work, and
``forward``, the model's forward with its inputs checked), ``chat_template`` (the one chat renderer:
a conversation as token ids, for the ``Conversation``, ``LLM.chat`` and the server), ``chat`` (a
conversation's state) and ``perplexity`` (a text's, its segments scored as prompts). The per-row
sampling tensors and the draw are ``mixtral_infer.sampling``.
"""

"""Generation: prompts in, tokens out.

``generate`` (prefill in chunks, then decode), ``sampling`` (temperature, top-p, top-k on the
device), ``settings`` (checks every setting before any heavy work), ``chat`` (the instruct
format and a conversation's state) and ``perplexity`` (a text's, its segments scored as prompts).
The static-shaped CUDA decode step is in ``mixtral_infer.fast``.

Nothing is imported here (the function is ``mixtral_infer.generate``, or
``mixtral_infer.generation.generate.generate``): ``steps.decode_step`` uses
``generation.sampling`` and ``generate`` uses ``fast``, so importing ``generate`` with the
package made an import cycle for whoever imported ``fast`` first (the serving engine's process).
"""

"""Stop strings on streamed text: ``StopStrings`` lives in ``generation.text_stream`` since ``generate``
(and so ``LLM``) finds stop strings with it as the server does; its name stays importable from here.
"""

from mixtral_infer.generation.text_stream import StopStrings

__all__ = ["StopStrings"]

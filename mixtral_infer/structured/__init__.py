"""Structured output: the tokens a row may sample next, from a grammar (llguidance), and the
per-row changes to the logits clients ask for (penalties, biases): see ``grammar`` and ``logits``."""

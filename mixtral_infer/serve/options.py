"""The options of ``python main.py serve``, checked before anything heavy is imported or loaded
(torch, uvicorn and the model take seconds; a mistyped port should not)."""

from __future__ import annotations

from mixtral_infer.errors import GenerationError
from mixtral_infer.errors import as_int


def check_serve_options(
    port: object, max_rows: object, memory_fraction: object, max_queue: object, prefill_tokens: object,
    max_model_len: object, shutdown_timeout: object, admit_every: object = None, reuse_slack: object = 0,
) -> None:
    """Every option of ``serve``, checked before the model is loaded."""
    if as_int(port) is None or not 0 <= as_int(port) < 65536:
        raise GenerationError(f"--port {port!r} must be an integer in [0, 65535] (0: any free port)")
    for name, value, least in (("max_rows", max_rows, 1), ("max_model_len", max_model_len, 1), ("admit_every", admit_every, 1)):
        if value is not None and (as_int(value) is None or as_int(value) < least):
            raise GenerationError(f"--{name.replace('_', '-')} {value!r} must be an integer >= {least}")
    for name, value, least in (("max_queue", max_queue, 0), ("prefill_tokens", prefill_tokens, 1), ("reuse_slack", reuse_slack, 0)):
        if as_int(value) is None or as_int(value) < least:
            raise GenerationError(f"--{name.replace('_', '-')} {value!r} must be an integer >= {least}")
    if memory_fraction is not None and (
        isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) or not 0 < memory_fraction <= 1
    ):
        raise GenerationError(f"--memory-fraction {memory_fraction!r} must be a number in (0, 1]")
    if isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, (int, float)) or shutdown_timeout < 0:
        raise GenerationError(f"--shutdown-timeout {shutdown_timeout!r} must be a number of seconds >= 0")

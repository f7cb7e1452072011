"""The command line: ``demo``, ``interactive``, ``perplexity``, ``convert``, ``models``, ``serve`` (``commands``)."""

import sys


def main() -> int:
    """The command line's entry point (``mixtral-infer``, ``main.py``, ``python -m mixtral_infer``). A
    Ctrl-C while its modules are still being imported ends it as one later does: exit 130, no traceback."""
    try:
        from mixtral_infer.cli.commands import main as run
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return run()


__all__ = ["main"]

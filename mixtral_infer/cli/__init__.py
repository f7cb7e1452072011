"""The command line: ``demo``, ``interactive``, ``convert``, ``models`` (``commands``)."""

from mixtral_infer.cli.commands import main

__all__ = ["main"]

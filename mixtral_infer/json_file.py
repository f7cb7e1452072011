"""Reading a JSON file that must hold an object (params.json, config.json, a tokenizer's files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Type


def read_object(path: Path, error: Type[Exception]) -> dict:
    """The JSON object in ``path``; ``error`` (one line, naming the file) when it cannot be read,
    is not JSON, or holds something other than an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:  # arrays or objects nested some thousands deep
        raise error(f"{path}: not valid JSON (nested too deeply)") from None
    except (OSError, ValueError) as problem:  # ValueError: JSONDecodeError, UnicodeDecodeError, a number of 5000 digits
        lines = str(problem).strip().splitlines()
        raise error(f"{path}: not valid JSON ({type(problem).__name__}: {lines[0] if lines else ''})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data

"""The package version: from the installed metadata, else from pyproject.toml beside a source checkout."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path


def _version() -> str:
    try:
        return metadata.version("mixtral_infer")
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        match = re.search(r'^version = "([^"]+)"', pyproject.read_text(encoding="utf-8"), re.M) if pyproject.is_file() else None
        return f"{match[1]}+source" if match else "0+unknown"


__version__ = _version()

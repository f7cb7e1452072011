"""Models named as on the Hugging Face hub (``mistralai/Mistral-7B-v0.1``), found in the local
Hugging Face cache, offline: this package never downloads.

The cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``, read when a
name is resolved. A model there is ``models--{org}--{name}/snapshots/{commit}/``, the commit named
by ``refs/main``; ``huggingface_hub.snapshot_download(..., local_files_only=True)`` finds it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from mixtral_infer.errors import CheckpointError

HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_cache() -> Path:
    """Where the Hugging Face cache is now (module docstring)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    return home / "hub"


def is_hub_name(name: str) -> bool:
    """``org/model`` (one slash, no path of its own): ``is_hub_name("mistralai/Mistral-7B-v0.1")``."""
    return bool(HUB_NAME.match(name))


def hub_folder(name: str) -> Path:
    """The cached snapshot folder of hub model ``name``; ``CheckpointError`` saying where it looked and
    how to download it when it is not there."""
    cache = hub_cache()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a dependency
        raise CheckpointError(f"{name}: a hub name needs huggingface_hub (pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(name, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise CheckpointError(
            f"{name}: model folder not found, nor in the Hugging Face cache {cache} (HF_HUB_CACHE / HF_HOME): "
            f"download it first, `hf download {name}` (this package never downloads)"
        ) from None

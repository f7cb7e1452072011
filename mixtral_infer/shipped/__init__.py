"""The small models shipped inside the package, usable by name wherever a model folder is accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

from mixtral_infer.hub import hub_folder, is_hub_name

SHIPPED_MODELS = Path(__file__).parent
DEFAULT_MODEL_NAME = "tiny-mixtral"


def shipped_models() -> Dict[str, Path]:
    """Name -> folder of each shipped model (``tiny-mixtral``, ``tiny-mistral``)."""
    return {path.name: path for path in sorted(SHIPPED_MODELS.iterdir()) if (path / "params.json").is_file()}


def resolve_model_folder(folder: str | Path) -> Path:
    """``folder`` itself when it exists, else the shipped model of that name, else for a hub name
    (``org/model``) its snapshot in the Hugging Face cache (``hub``), else ``folder`` unchanged.

    A folder on disk wins over a shipped model or a hub model of the same name, so
    ``./tiny-mixtral`` (a conversion, say) is never shadowed.
    """
    path = Path(folder)
    if path.exists():
        return path
    shipped = shipped_models().get(str(folder))
    if shipped is not None:
        return shipped
    if isinstance(folder, str) and is_hub_name(folder):
        return hub_folder(folder)
    return path


def is_shipped(folder: str | Path) -> bool:
    """True for the folder of a shipped model (whatever name or path reached it)."""
    path = Path(folder).resolve()
    return path.parent == SHIPPED_MODELS.resolve() and (path / "params.json").is_file()

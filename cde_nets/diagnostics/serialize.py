"""Plain-data form of diagnostic results: tensors become (nested) lists, so ``json.dumps`` accepts them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

__all__ = ["to_jsonable", "save_json"]


def to_jsonable(obj: Any) -> Any:
    """``obj`` with every tensor/array turned into floats or nested lists and tuples into lists.

    Non-finite floats become ``None`` (JSON has no NaN/inf).
    """
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        return to_jsonable(obj.item() if obj.dim() == 0 else obj.tolist())
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        return to_jsonable(obj.tolist())
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    raise TypeError(f"cannot turn {type(obj).__name__} into JSON; convert it to a float, list or dict first.")


def save_json(result: dict, path: str | Path) -> Path:
    """Write ``to_jsonable(result)`` to ``path`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(result), indent=2))
    return path

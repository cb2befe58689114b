"""Every Python code block of the README and the guides runs as written, so an example can never rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        for k, m in enumerate(BLOCK.finditer(page.read_text())):
            out.append((str(page.relative_to(ROOT)), k, m.group(1)))
    return out


@pytest.mark.parametrize(("page", "k", "code"), _blocks(), ids=[f"{p}-{k}" for p, k, _ in _blocks()])
def test_code_block_runs(page: str, k: int, code: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = torch.get_default_dtype()
    try:
        exec(compile(code, f"{page}[block {k}]", "exec"), {"__name__": f"docs_{k}"})
    finally:
        torch.set_default_dtype(default)

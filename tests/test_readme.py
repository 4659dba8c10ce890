"""The documentation's Python examples run, so they cannot rot.

Every ```` ```python ```` block of ``README.md`` and ``docs/*.md`` is executed on its own,
in a fresh namespace, in a temporary working directory. A block that cannot run (a sketch
with placeholders) carries ``<!-- no-run: why -->`` on the line right before its fence; it
is still compiled, so its syntax stays valid.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```python[ \t]*$")
_NO_RUN = re.compile(r"^<!--\s*no-run:\s*(\S.*?)\s*-->$")


@attrs.frozen
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    no_run: str | None  # the stated reason, for a sketch

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(text: str, path: Path) -> list[Block]:
    """The ```` ```python ```` blocks of a Markdown text, with their no-run markers."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            start = i
            i += 1
            body: list[str] = []
            while i < len(lines) and lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{path}:{start + 1}: ```python block never closed")
            marker = _NO_RUN.match(lines[start - 1].strip()) if start else None
            blocks.append(
                Block(path, start + 1, "\n".join(body) + "\n", marker.group(1) if marker else None)
            )
        i += 1
    return blocks


BLOCKS = [b for doc in DOCS for b in python_blocks(doc.read_text(), doc)]


def test_the_readme_has_runnable_examples() -> None:
    readme = [b for b in BLOCKS if b.path.name == "README.md"]
    assert len(readme) >= 2 and all(b.no_run is None for b in readme)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_python_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = compile(block.code, block.id, "exec")
    if block.no_run is not None:
        pytest.skip(f"marked no-run: {block.no_run} (compiled only)")
    monkeypatch.chdir(tmp_path)
    exec(code, {"__name__": f"doc_{block.line}"})
    assert os.getcwd() == str(tmp_path)


def test_the_block_finder() -> None:
    text = "\n".join(
        [
            "intro",
            "```python",
            "x = 1",
            "```",
            "<!-- no-run: needs a GPU -->",
            "```python",
            "y = x",
            "```",
            "```toml",
            "a = 1",
            "```",
        ]
    )
    blocks = python_blocks(text, ROOT / "README.md")
    assert [(b.line, b.code, b.no_run) for b in blocks] == [
        (2, "x = 1\n", None),
        (6, "y = x\n", "needs a GPU"),
    ]
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\nx = 1\n", ROOT / "README.md")

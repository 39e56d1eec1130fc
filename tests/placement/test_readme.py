"""The placement README's code runs as written and prints what its comments say.

Every fenced ``python`` block runs (in a temporary directory: one draws a picture); a line
``expr  # value`` whose comment starts with a Python literal must evaluate to it, and a comment
of times ("~1.12 s, ~0.37 s, 0.35 s") must match the tuple the line evaluates to (``~``: within
the last printed digit's rounding plus 2%; plain: equal when rounded as printed)."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[2] / "packages" / "placement" / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
TIMES = re.compile(r"^(~?\d+(?:\.\d+)? s)(, ~?\d+(?:\.\d+)? s)*")


def _expected(comment: str) -> Any:
    """The literal a comment starts with (None when it starts with words)."""
    head = comment.split(": ")[0].strip()
    for text in (comment.strip(), head):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue
    return None


def _times_match(comment: str, values: Any) -> bool:
    figures = [f.strip() for f in TIMES.match(comment).group(0).split(",")]  # type: ignore[union-attr]
    values = values if isinstance(values, tuple) else (values,)
    if len(figures) != len(values):
        return False
    for figure, value in zip(figures, values, strict=True):
        text = figure.removeprefix("~").removesuffix(" s")
        decimals = len(text.split(".")[1]) if "." in text else 0
        if figure.startswith("~"):
            if not math.isclose(value, float(text), rel_tol=0.02, abs_tol=0.5 * 10**-decimals):
                return False
        elif round(value, decimals) != float(text):
            return False
    return True


def test_the_readme_has_its_examples() -> None:
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_readme_block_runs_and_prints_what_it_says(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    checked = 0
    for node in ast.parse(BLOCKS[index]).body:
        code = compile(ast.Module([node], []), "README.md", "exec")
        segment = ast.get_source_segment(BLOCKS[index], node) or ""
        line = BLOCKS[index].splitlines()[node.end_lineno - 1]  # type: ignore[operator]
        comment = line.split("  # ", 1)[1] if "  # " in line else ""
        if isinstance(node, ast.Expr) and comment:
            value = eval(compile(ast.Expression(node.value), "README.md", "eval"), scope)
            if TIMES.match(comment):
                assert _times_match(comment, value), (segment, comment, value)
                checked += 1
            elif (expected := _expected(comment)) is not None:
                assert value == expected, (segment, comment, value)
                checked += 1
            continue
        exec(code, scope)
    assert checked or index > 0 or not BLOCKS

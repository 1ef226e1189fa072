"""Module docstrings fit a screenful: what the module is for and how data flows through it.

Measurements, tables and history belong in docs/benchmarks.md, where they can be re-run and
replaced; a docstring that grows past a screen has usually started collecting them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import echo2swarm

ROOT = Path(echo2swarm.__file__).parent
MAX_LINES = 40


def docstring_lines(path: Path) -> int:
    """Source lines the module docstring spans, quotes included (0 without one)."""
    body = ast.parse(path.read_text(), str(path)).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0].end_lineno - body[0].lineno + 1  # type: ignore[operator]
    return 0


def test_no_module_docstring_is_over_a_screenful() -> None:
    long = {str(p.relative_to(ROOT.parent)): n for p in sorted(ROOT.rglob("*.py")) if (n := docstring_lines(p)) > MAX_LINES}
    assert long == {}, f"module docstrings over {MAX_LINES} lines (move tables and history to docs/benchmarks.md)"


def test_the_count_covers_the_whole_literal(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""One.\n\nTwo.\n"""\n\nx = 1\n')
    assert docstring_lines(module) == 4
    module.write_text("x = 1\n")
    assert docstring_lines(module) == 0

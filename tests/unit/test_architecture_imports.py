"""docs/architecture.md lists what each package imports of ours; the list is the code's.

test_layers.py says which imports are allowed; this says which there are, so the page draws what
is. Lazy imports inside functions count: they are dependencies too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import echo2swarm

ROOT = Path(echo2swarm.__file__).parent
DOC = ROOT.parent / "docs" / "architecture.md"


def package_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """{package: the other echo2swarm packages its modules import}."""
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    out: dict[str, set[str]] = {name: set() for name in packages}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    assert not node.level, f"{path}: relative import (this check reads absolute ones only)"
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "echo2swarm" and len(parts) > 1 and parts[1] in packages and parts[1] != package:
                        out[package].add(parts[1])
    return out


def documented_imports(text: str) -> dict[str, set[str]]:
    block = text.split("What each package imports of ours", 1)[1].split("```", 2)[1]
    out = {}
    for line in block.strip().splitlines():
        package, _, rest = line.partition("─►")
        out[package.strip()] = set(re.sub(r"\(.*?\)", "", rest).split())
    return out


def test_the_page_lists_every_package_with_what_it_imports() -> None:
    assert documented_imports(DOC.read_text()) == package_imports()


def test_the_reader_sees_lazy_imports_and_ignores_its_own_package(tmp_path: Path) -> None:
    root = tmp_path / "echo2swarm"
    for package in ("a", "b"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "a" / "m.py").write_text("import echo2swarm.a.x\ndef f():\n    from echo2swarm.b.y import z\n")
    (root / "b" / "m.py").write_text("from echo2swarm.b import y\nimport torch\n")
    assert package_imports(root) == {"a": {"b"}, "b": set()}
    text = "What each package imports of ours:\n```\na ─► b   (never c)\nb ─► (nothing of ours)\n```\n"
    assert documented_imports(text) == {"a": {"b"}, "b": set()}

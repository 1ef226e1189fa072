"""docs/protocol.md as tests read it: numbered sections, field tables under a caption, fenced blocks.

The doc keeps these machine-readable on purpose: a schema is a table right after a caption line
(`` `PeerCard` fields:``) whose header starts `| field |` and whose every row names one field in
backticks; examples are fenced blocks.
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
HEADING = re.compile(r"^(#{2,4}) (\d+(?:\.\d+)*)\.? ", re.M)
_FIELD_CELL = re.compile(r"^`([a-z_]+)`$")


def text() -> str:
    return DOC.read_text(encoding="utf-8")


def headings(doc: str | None = None) -> list[str]:
    """The section numbers in the order they appear: "1", "2", "2.1", ..."""
    return [m.group(2) for m in HEADING.finditer(text() if doc is None else doc)]


def section(number: str, doc: str | None = None) -> str:
    """Section `number` ("4.3", "8") from its heading to the next heading of its level or above."""
    doc = text() if doc is None else doc
    found = list(HEADING.finditer(doc))
    for i, m in enumerate(found):
        if m.group(2) == number:
            level = len(m.group(1))
            end = next((n.start() for n in found[i + 1:] if len(n.group(1)) <= level), len(doc))
            return doc[m.start():end]
    raise KeyError(f"{DOC} has no section {number}")


def field_table(body: str, caption: str) -> list[str]:
    """The field names of the table right after the line starting with `caption`, in order."""
    lines = body.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(caption)]
    if len(starts) != 1:
        raise KeyError(f"{len(starts)} lines start with {caption!r}; a field table needs exactly one caption")
    rows = iter(lines[starts[0] + 1:])
    line = next(rows)
    while not line.strip():
        line = next(rows)
    if not line.startswith("| field |"):
        raise ValueError(f"the table after {caption!r} must have a header starting '| field |', not {line!r}")
    if not next(rows).startswith("|---"):
        raise ValueError(f"the table after {caption!r} lacks its |---| line")
    names = []
    for line in rows:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1].strip()
        match = _FIELD_CELL.fullmatch(cell)
        if match is None:
            raise ValueError(f"a row of the table after {caption!r} must name one field in backticks, not {cell!r}")
        names.append(match.group(1))
    return names


def fenced(body: str, info: str = "") -> list[str]:
    """The contents of the fenced blocks whose info string is `info` ("" : plain ``` blocks), in order."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in body.splitlines():
        if current is None and line.startswith("```"):
            current = []
            blocks.append((line[3:].strip(), current))
        elif current is not None and line == "```":
            current = None
        elif current is not None:
            current.append(line)
    return ["".join(f"{line}\n" for line in lines) for kind, lines in blocks if kind == info]


def hex_bytes(block: str) -> bytes:
    return bytes.fromhex(" ".join(block.split()))

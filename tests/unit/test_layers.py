"""The import direction of the package: each layer imports only the layers below it.

The order is the one written at the top of docs/architecture.md, and a test holds the two equal.
Packages in the same layer (the two planes, learner and rollout) never import each other: what
they both speak lives below them, in `wire`. Imports inside a function count too, since a lazy
import is still a dependency. Outside libraries have rules of their own (`OUTSIDE`): only the
overlay speaks hivemind, the training stack no network library, the control plane is pure.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import echo2swarm

ROOT = Path(echo2swarm.__file__).parent

# Lowest first. A package may import its own modules and any package in a lower layer.
LAYERS: list[set[str]] = [
    {"runtime"},              # leaf utilities: logging, processes, asyncio helpers, devices
    {"control"},              # capacity model and activation: pure logic, the rules config checks
    {"wire"},                 # records, signing, RPC messages: what crosses the network
    {"config"},               # typed configuration per role
    {"train"},                # the torch-only training stack: GRPO loss, trainer, verification
    {"overlay"},              # the only hivemind importer
    {"policy"},               # signed versions: manifests, chunk store, server, fetcher, follower
    {"tasks"},                # data-plane adapters
    {"models"},               # tiny local models for the demo and tests
    {"learner", "rollout", "sim"},  # the two planes, neither importing the other; the simulator of both
    {"daemon"},               # supervisor and role services: wires the planes together
    {"cli"},                  # commands
]
RANK = {package: i for i, layer in enumerate(LAYERS) for package in layer}
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"

# Outside libraries, per package: a top-level module name is "only" allowed in the packages listed,
# "never" allowed in those listed; "allowed" lists every module a package may import (it is pure).
NETWORK = {"hivemind", "google", "aiohttp", "asyncio", "socket", "ssl", "http", "urllib", "requests", "httpx",
           "websockets", "grpc", "zmq", "multiaddr"}
OUTSIDE: dict[str, dict[str, set[str]]] = {
    "only": {"hivemind": {"overlay"}, "google": {"overlay"}},    # libp2p and its protobufs: the overlay's
    "never": {"train": NETWORK},                                # torch-only: no network, no event loop
    "allowed": {"control": {"__future__", "abc", "bisect", "collections", "dataclasses", "enum", "functools",
                            "heapq", "itertools", "math", "random", "statistics", "typing"}},
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, name) for every echo2swarm import in the file, relative ones resolved.

    `from a.b import c` yields `a.b.c`: c may be a module or a name in a.b (see `resolve`).
    """
    own = module_name(path, root).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in out if name == "echo2swarm" or name.startswith("echo2swarm.")]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def back_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        here = layer_of(module_name(path, root))
        for line, target in imported(path, root):
            there = layer_of(target)
            if here is None or there is None or here == there:
                continue  # the root package (its __version__) is below everything
            if RANK[there] >= RANK[here]:
                bad.append(f"{path.relative_to(root.parent)}:{line} ({here}) imports {target} ({there})")
    return bad


def outside_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, top-level module) of every import of a module outside the package."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return [(line, name) for line, name in out if name != "echo2swarm"]


def outside_violations(root: Path = ROOT, rules: dict[str, dict[str, set[str]]] = OUTSIDE) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        here = layer_of(module_name(path, root))
        for line, name in outside_imports(path, root):
            where = f"{path.relative_to(root.parent)}:{line} ({here}) imports {name}"
            if name in rules["only"] and here not in rules["only"][name]:
                bad.append(f"{where}: only {', '.join(sorted(rules['only'][name]))} may")
            if name in rules["never"].get(here or "", set()):
                bad.append(f"{where}: {here} imports no network library")
            if here in rules["allowed"] and name not in rules["allowed"][here]:
                bad.append(f"{where}: {here} is pure (allowed: {', '.join(sorted(rules['allowed'][here]))})")
    return bad


def documented_layers(text: str) -> list[set[str]]:
    """The layer table of docs/architecture.md's section 0, lowest first: `| 3 | `config/` | ... |`."""
    section = text.split("## 0.", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if match:
            rows.append((int(match.group(1)), set(re.findall(r"`([a-z_]+)/`", match.group(2)))))
    return [packages for _, packages in sorted(rows)]


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(RANK), f"add new packages to LAYERS (and docs/architecture.md): {packages ^ set(RANK)}"


def test_imports_run_from_higher_layers_to_lower_ones() -> None:
    assert back_imports() == []


def test_outside_libraries_stay_where_they_belong() -> None:
    assert outside_violations() == []


def test_the_documented_layer_table_is_the_code_s() -> None:
    documented = documented_layers(ARCHITECTURE.read_text())
    assert documented == LAYERS, "docs/architecture.md section 0 and LAYERS here must list the same layers"


def test_no_import_cycles_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    for name, path in modules.items():
        targets = set()
        for _, target in imported(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name and target != "echo2swarm":
                targets.add(target)
        graph[name] = targets
    # Tarjan's strongly connected components: any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_checker_sees_back_imports(tmp_path: Path) -> None:
    # The checker must not be blind: lazy, relative and sibling-plane imports are all flagged.
    root = tmp_path / "echo2swarm"
    for package in ("policy", "learner", "rollout", "runtime"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "policy" / "probe.py").write_text("def f():\n    from echo2swarm.learner import trainer\n")
    (root / "rollout" / "probe.py").write_text("from ..learner.protocol import Lease\n")
    (root / "runtime" / "probe.py").write_text("import echo2swarm.policy.store\n")
    (root / "learner" / "probe.py").write_text("from echo2swarm.policy import store\nfrom . import probe\n")
    assert back_imports(root) == [
        "echo2swarm/policy/probe.py:2 (policy) imports echo2swarm.learner.trainer (learner)",
        "echo2swarm/rollout/probe.py:1 (rollout) imports echo2swarm.learner.protocol.Lease (learner)",
        "echo2swarm/runtime/probe.py:1 (runtime) imports echo2swarm.policy.store (policy)",
    ]


def test_the_checker_sees_outside_libraries_where_they_do_not_belong(tmp_path: Path) -> None:
    root = tmp_path / "echo2swarm"
    for package in ("overlay", "daemon", "train", "control"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "overlay" / "ok.py").write_text("from hivemind.p2p import P2P\nimport asyncio\n")
    (root / "daemon" / "probe.py").write_text("def f():\n    from hivemind.p2p import P2P\n")
    (root / "train" / "probe.py").write_text("import torch\nimport aiohttp.web\n")
    (root / "control" / "probe.py").write_text("import math\nimport numpy as np\n")
    assert outside_violations(root) == [
        "echo2swarm/control/probe.py:2 (control) imports numpy: control is pure (allowed: " + ", ".join(
            sorted(OUTSIDE["allowed"]["control"])) + ")",
        "echo2swarm/daemon/probe.py:2 (daemon) imports hivemind: only overlay may",
        "echo2swarm/train/probe.py:2 (train) imports aiohttp: train imports no network library",
    ]


def test_the_table_reader_sees_a_reordered_or_missing_layer() -> None:
    text = ARCHITECTURE.read_text()
    assert documented_layers(text) == LAYERS
    swapped = text.replace("| `overlay/` |", "| `policy_x/` |", 1)
    assert documented_layers(swapped) != LAYERS
    dropped = "\n".join(line for line in text.splitlines() if "| `train/` |" not in line)
    assert documented_layers(dropped) != LAYERS

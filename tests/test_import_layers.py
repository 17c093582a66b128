"""The package layering of docs/architecture.md, read from the imports in the code (every import, at module
level or inside a function), so an import that breaks it fails here.

  bottom   kv_transfer, pdserve_proto (generated stubs); engine (may use kv_transfer)
  common   the foundation: protocol, gRPC helpers, cluster auth, metrics HTTP, Redis, client library
  middle   router; worker_runtime, and the roles plugged into it (prefill_worker, decode_worker)
  roof     planner, loadtest (chaos under it), pdserve (CLI, cluster, demo, offline)
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOTTOM = {"engine", "kv_transfer", "pdserve_proto"}
ALLOWED = {
    "pdserve_proto": set(),
    "kv_transfer": set(),
    "engine": {"kv_transfer"},
    "common": BOTTOM,
    "router": BOTTOM | {"common"},
    "worker_runtime": BOTTOM | {"common"},
    "prefill_worker": BOTTOM | {"common", "worker_runtime"},
    "decode_worker": BOTTOM | {"common", "worker_runtime"},
    "planner": BOTTOM | {"common", "router"},
    "loadtest": BOTTOM | {"common"},
    "pdserve": BOTTOM | {"common", "router", "worker_runtime", "prefill_worker", "decode_worker", "planner",
                         "loadtest"},
}


def package_imports(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """{package: {imported package: the first file importing it}} between the top-level packages."""
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()} - {"tests"}
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in packages and top != package:
                        edges[package].setdefault(top, str(path.relative_to(root)))
    return edges


def violations(edges: dict[str, dict[str, str]]) -> list[str]:
    """Each import the layering forbids, with the file that makes it; a package the rule does not know."""
    found = []
    for package, imported in sorted(edges.items()):
        if package not in ALLOWED:
            found.append(f"{package} is not placed in a layer (tests/test_import_layers.py ALLOWED)")
            continue
        for target, where in sorted(imported.items()):
            if target not in ALLOWED[package]:
                found.append(f"{package} must not import {target} ({where})")
    return found


def test_the_tree_keeps_its_layers():
    assert violations(package_imports()) == []


def test_every_package_is_placed():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests"}
    assert packages <= set(ALLOWED), packages - set(ALLOWED)


def test_the_allowed_graph_has_no_cycle():
    state: dict[str, str] = {}

    def visit(node: str) -> None:
        state[node] = "open"
        for nxt in ALLOWED[node]:
            assert state.get(nxt) != "open", f"cycle through {node} -> {nxt}"
            if nxt not in state:
                visit(nxt)
        state[node] = "done"

    for package in ALLOWED:
        if package not in state:
            visit(package)


def test_a_wrong_import_is_caught(tmp_path):
    """The check itself: a worker runtime importing a role, and the router importing a worker package."""
    for package, source in {"worker_runtime": "from decode_worker.decode_loop import DecodeLoop\n",
                            "decode_worker": "", "router": "def f():\n    import worker_runtime.config\n"}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "x.py").write_text(source)
    assert violations(package_imports(tmp_path)) == [
        "router must not import worker_runtime (router/x.py)",
        "worker_runtime must not import decode_worker (worker_runtime/x.py)"]

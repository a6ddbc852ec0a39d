"""Layers only point down: every `mtkc` import goes to the same or a lower layer, at module level.

    cli -> commands -> pipeline -> backend, runtime -> manager, target -> passes -> analysis
        -> rewrite -> options -> contract -> ir -> errors

No two packages (folders) import each other, even through others (CYCLES_LEFT lists the ones left).
Parsed with `ast` (nothing is imported). A function-level `mtkc` import is how a cycle hides, so
it fails too, except where ALLOWED lists it (each entry says who removes it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"compiler": "mtkc", "passes": "mtkc.passes"}

# Top first; modules of one row may import each other (within a row, a package imports itself freely).
LAYERS = [
    ("mtkc.cli", "mtkc.__main__"),
    ("mtkc.commands",),
    ("mtkc.pipeline",),
    ("mtkc.backend", "mtkc.runtime"),
    ("mtkc.manager", "mtkc.target"),
    ("mtkc.passes",),
    ("mtkc.analysis",),
    ("mtkc.rewrite",),
    ("mtkc.options",),
    ("mtkc.contract",),
    ("mtkc.ir",),
    ("mtkc.errors", "mtkc"),
]

# Remaining function-level imports, (module, imported module). Owners are removing them; the lead
# empties this list as their branches land.
ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    for folder, package in PACKAGES.items():
        if path.is_relative_to(ROOT / folder):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise ValueError(path)


def layer(module: str) -> int:
    """Index of the most specific row naming `module` or one of its packages."""
    best, depth = None, -1
    for i, row in enumerate(LAYERS):
        for prefix in row:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    assert best is not None, f"{module} is in no layer"
    return best


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported mtkc module, inside a function) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, in_function) for a in child.names if a.name.startswith("mtkc"))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").startswith("mtkc"):
                found.append((child.lineno, child.module, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def edges() -> list[tuple[str, int, str, bool]]:
    out = []
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = module_name(path)
            out += [(module, line, target, local) for line, target, local in imports(path)]
    return out


def test_imports_point_down():
    upward = [f"{m}:{line} imports {t}" for m, line, t, _ in edges() if layer(t) < layer(m)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_function_level_imports():
    local = [f"{m}:{line} imports {t} inside a function" for m, line, t, is_local in edges()
             if is_local and (m, t) not in ALLOWED]
    assert not local, "move shared code down instead:\n" + "\n".join(local)


def test_no_import_cycles():
    """Modules of one row may import each other, but never in a circle."""
    graph = nx.DiGraph((m, t) for m, _, t, _ in edges() if m != t)
    assert not list(nx.simple_cycles(graph)), "import cycles"


# Package-level cycles left, (package, package). The lead empties this as their branches land.
CYCLES_LEFT: set[frozenset[str]] = set()


def package(module: str, packages: set[str]) -> str:
    """The package (folder) of a module: itself for a package or a top-level module (`mtkc.cli`), else its parent."""
    parent = module.rsplit(".", 1)[0]
    return module if module in packages or parent == "mtkc" or "." not in module else parent


def test_no_package_cycles():
    """Folders import each other in one direction only (`backend` ⇄ `runtime` would be a cycle)."""
    packages = {module_name(p) for folder in PACKAGES for p in (ROOT / folder).rglob("__init__.py")}
    packages.discard("mtkc")  # its top-level modules (cli, errors, display, options) are each their own
    graph = nx.DiGraph()
    for m, _, t, _ in edges():
        a, b = package(m, packages), package(t, packages)
        if a != b and "mtkc" not in (a, b):  # (`mtkc/__init__.py` holds only the version)
            graph.add_edge(a, b)
    cycles = {frozenset(c) for c in nx.simple_cycles(graph)}
    assert not cycles - CYCLES_LEFT, f"package cycles: {sorted(sorted(c) for c in cycles - CYCLES_LEFT)}"
    assert not CYCLES_LEFT - cycles, f"stale CYCLES_LEFT entries: {sorted(sorted(c) for c in CYCLES_LEFT - cycles)}"


def test_allow_list_is_current():
    """An entry whose import is gone must leave ALLOWED (so the list only shrinks)."""
    present = {(m, t) for m, _, t, is_local in edges() if is_local}
    assert not ALLOWED - present, f"stale ALLOWED entries: {sorted(ALLOWED - present)}"


def test_the_manager_imports_no_pass():
    """The pass manager manages the passes it is given (`mtkc.pipeline.registry` names mtkc's built-ins)."""
    found = []
    for path in sorted((ROOT / "compiler" / "manager").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module if isinstance(node, ast.ImportFrom) else None
            targets = [f"{module}.{n}" for n in names] if module else names
            found += [f"{path.name}:{node.lineno} imports {t}" for t in targets if t.startswith("mtkc.passes")]
    assert not found, found

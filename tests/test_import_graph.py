"""The package's import graph has no circle: ``hsx``, ``producer``, ``workers`` and ``settings``, with
module-level and function-local imports both (a function-local import only hides a circle until the
function runs). Read with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hsx", "producer", "workers")
TOP_MODULES = ("settings",)


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the project's own top-level names."""
    out = {}
    for top in TOP_MODULES:
        out[top] = ROOT / f"{top}.py"
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file (``from x import y`` names ``x.y``
    when that is a module), with the packages an import initialises on the way (but not ``module``'s
    own packages: Python runs those before it, whatever it imports)."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    out = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and prefix not in own and prefix != module:
                out.add(prefix)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edges_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]


def test_no_module_of_the_package_imports_itself_through_others():
    modules = _modules()
    known = set(modules)
    graph = {name: _imported(name, path, known) for name, path in modules.items()}
    circles = _circles(graph)
    assert not circles, "import circles (move what both sides need into a module below them):\n" + "\n".join(
        "  " + ", ".join(_edges_within(graph, c)) for c in circles)


def test_the_graph_reader_sees_a_function_local_circle(tmp_path):
    """The reader itself: a circle closed only by a function-local import is found."""
    a = tmp_path / "a.py"
    b = tmp_path / "b.py"
    a.write_text("import b\n")
    b.write_text("def f():\n    from a import x\n")
    known = {"a", "b"}
    graph = {"a": _imported("a", a, known), "b": _imported("b", b, known)}
    assert _circles(graph) == [["a", "b"]]

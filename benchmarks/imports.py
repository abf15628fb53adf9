"""The shape of the imports, measured from the source: import circles between files, and project imports inside
functions (which hide circles rather than remove them).

    python -m benchmarks.imports            exporters/ and models/ of this checkout
    python -m benchmarks.imports --root DIR another checkout (an earlier commit, to compare)

Every ``from exporters... import`` / ``from models... import`` counts, those under ``if TYPE_CHECKING:`` too (a circle
through a type is still a circle a reader walks). Prints each circle (a strongly connected set of files) and each
function-local import with its place; the last line is the counts.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGES = ("exporters", "models")


def module_of(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path, root: Path, known: set[str]) -> tuple[set[str], list[str]]:
    """The project modules ``path`` imports, and its imports inside functions (``file:line module``)."""
    tree = ast.parse(path.read_text())
    found, local = set(), []
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(PACKAGES):
            continue
        names = [f"{node.module}.{a.name}" for a in node.names]  # `from exporters import console` names a module
        targets = {n for n in names if n in known} or {node.module}
        found |= {t for t in targets if t in known}
        if id(node) in inside:
            local.append(f"{path.relative_to(root)}:{node.lineno} {node.module}")
    return found, local


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one file."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    root = Path(parser.parse_args().root).resolve()
    files = {module_of(p, root): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}
    graph, local = {}, []
    for name, path in files.items():
        graph[name], inner = imports(path, root, set(files))
        graph[name].discard(name)
        local += inner
    found = circles(graph)
    for component in found:
        print("circle:", " -> ".join(component))
    for place in local:
        print("inside a function:", place)
    print(f"{len(files)} files, {sum(len(v) for v in graph.values())} imports between them, {len(found)} circles, "
          f"{len(local)} project imports inside functions")


if __name__ == "__main__":
    main()

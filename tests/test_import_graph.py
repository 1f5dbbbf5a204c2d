"""The package's modules import one way: read from their own source (every relative import, at the top or inside a
function), the graph of `ran_hf`'s modules has no cycle: no lazy import hides one."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ran_hf"
MODULES = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")


def relative_imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import x
                found.update(alias.name for alias in node.names)
    return found & set(MODULES)


def test_the_package_imports_have_no_cycle():
    graph = {module: relative_imports(module) for module in MODULES}
    state = {}  # module -> "visiting" / "done"

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "visiting", "import cycle: " + " -> ".join(path + [module])
        state[module] = "visiting"
        for imported in sorted(graph[module]):
            visit(imported, path + [module])
        state[module] = "done"

    for module in MODULES:
        visit(module, [])

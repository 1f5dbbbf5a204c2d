"""The package's modules import one way: read from their own source (every relative import, at the top or inside a
function, `from .x`, `from .files.x`, `from ..x` alike), the graph of `ran_hf`'s modules, the flat modeling modules
and those of the `files` subpackage, has no cycle: no lazy import hides one. A saved folder carries flat modules only,
so no modeling module imports the subpackage: only the converter and the ONNX export, which no folder carries."""

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ran_hf"
SUBPACKAGES = ("files", "integrations")
# Each module by its name under `ran_hf` ("configuration_ran", "files.folders", "files" for its __init__), with its
# file.
SOURCES = {path.stem: path for path in PACKAGE.glob("*.py") if path.stem != "__init__"} | {
    subpackage if path.stem == "__init__" else f"{subpackage}.{path.stem}": path
    for subpackage in SUBPACKAGES
    for path in (PACKAGE / subpackage).glob("*.py")
}
MODULES = sorted(SOURCES)
# The flat modules that may import a subpackage: tools, not modeling code, which no saved folder carries.
IMPORT_FILES = {"export"}


def resolve(parts: list[str]) -> str | None:
    """The module of `ran_hf` that the dotted `parts` name, or that holds the name they end with."""
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in SOURCES:
            return ".".join(parts[:end])
    return None


def relative_imports(module: str) -> set[str]:
    tree = ast.parse(SOURCES[module].read_text())
    # The package the module sits in: [] for a flat module, ["files"] for the subpackage's modules and its __init__.
    package = module.split(".") if SOURCES[module].stem == "__init__" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        assert node.level - 1 <= len(package), f"{module}: an import above ran_hf"
        base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        for alias in node.names:  # from .files import folders: a module; from .folders import x: a name in one
            target = resolve(base + [alias.name]) or resolve(base)
            if target:
                found.add(target)
    return found


GRAPH = {module: relative_imports(module) for module in MODULES}


def test_the_graph_reads_both_levels():
    # The resolution itself: a flat module's import of the subpackage and a sibling's, and the subpackage's modules.
    converter = GRAPH["integrations.convert_rannet"]
    assert "files.folders" in converter and "files.tf_checkpoint" in converter and "modeling_ran" in converter
    assert "files.folders" in GRAPH["export"]
    assert "configuration_ran" in GRAPH["modeling_ran"]
    assert {"files.data", "files.folders", "files.tf_checkpoint"} <= set(MODULES)


def test_the_package_imports_have_no_cycle():
    state = {}  # module -> "visiting" / "done"

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "visiting", "import cycle: " + " -> ".join(path + [module])
        state[module] = "visiting"
        for imported in sorted(GRAPH[module]):
            visit(imported, path + [module])
        state[module] = "done"

    for module in MODULES:
        visit(module, [])


def test_no_modeling_module_imports_a_subpackage():
    flat = [module for module in MODULES if "." not in module]
    importers = {module for module in flat if any(imported.split(".")[0] in SUBPACKAGES for imported in GRAPH[module])}
    assert importers <= IMPORT_FILES, f"modeling modules importing {SUBPACKAGES}: {sorted(importers - IMPORT_FILES)}"


def test_the_subpackage_init_imports_nothing():
    # `import ran_hf.files.folders` costs that module alone (the scripts import one module of it, not all three).
    for subpackage in SUBPACKAGES:
        tree = ast.parse((PACKAGE / subpackage / "__init__.py").read_text())
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not imports, f"ran_hf.{subpackage} imports at once: {[ast.unparse(node) for node in imports]}"

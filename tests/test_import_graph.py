"""The package's modules import one way: read from their own source (every relative import, at the top or inside a
function, `from .x`, `from .files.x`, `from ..x` alike), the graph of `ran_hf`'s modules, the flat modeling modules
and those of the subpackages (`files`, `integrations`, `kernels` and its `triton_ops`), has no cycle: no lazy import
hides one. A saved folder carries flat modules only, so no modeling module imports a subpackage but the two modules of `files`
that a folder carries flat. The model reaches its kernels in one place, `kernel_hub`'s guarded import of the installed
`ran_hf.kernels` (which a saved folder's copy makes too), and the kernels import only modeling modules that attach
no kernel: importing either never needs the other half-imported."""

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ran_hf"
SUBPACKAGES = ("files", "integrations", "kernels")
# Each module by its name under `ran_hf` ("configuration_ran", "files.folders", "files" for its __init__,
# "kernels.triton_ops.norm"), with its file.
SOURCES = {
    ".".join(path.relative_to(PACKAGE).with_suffix("").parts[: -1 if path.stem == "__init__" else None]): path
    for path in PACKAGE.rglob("*.py")
    if path.relative_to(PACKAGE).parts[0] in SUBPACKAGES or len(path.relative_to(PACKAGE).parts) == 1
}
SOURCES.pop("")  # ran_hf's own __init__: registrations, no modeling code
MODULES = sorted(SOURCES)
FLAT = [module for module in MODULES if SOURCES[module].parent == PACKAGE]  # the modeling modules a folder carries
# The subpackage modules a modeling module may import: the guarded writes, the shipped-code list and the weights
# files' reader, which a saved folder carries flat (files/saved_code.py makes their imports flat), and which import
# each other only.
SHIPPED_FLAT = {"files.safe_writes", "files.saved_code", "files.weight_files"}


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
    assert (
        "files.folders" in converter and "integrations.rannet_checkpoint" in converter and "modeling_ran" in converter
    )
    assert "files.tf_checkpoint" in GRAPH["integrations.rannet_checkpoint"]
    assert "files.folders" in GRAPH["integrations.onnx_export"]
    assert "configuration_ran" in GRAPH["modeling_ran"]
    assert {"files.data", "files.folders", "files.tf_checkpoint"} <= set(MODULES)
    # Two levels down, and back up: the Triton scan's kernels, and the kernels' reads of the model's scan inputs.
    assert "kernels.triton_ops.scan_forward" in GRAPH["kernels.triton_ops.scan_backward"]
    assert "kernels.triton_ops" in GRAPH["kernels.triton_ops.norm"]
    assert "scan_inputs" in GRAPH["kernels.fused_scan"]


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


def test_no_modeling_module_imports_a_subpackage_but_what_a_folder_carries_flat():
    imported = {name for module in FLAT for name in GRAPH[module] if name.split(".")[0] in SUBPACKAGES}
    assert imported <= SHIPPED_FLAT, f"modeling modules importing {SUBPACKAGES}: {sorted(imported - SHIPPED_FLAT)}"
    assert all(GRAPH[module] <= SHIPPED_FLAT for module in SHIPPED_FLAT)


def test_the_subpackage_init_imports_nothing():
    # `import ran_hf.files.folders` costs that module alone (the scripts import one module of it, not all three).
    for subpackage in ("files", "integrations"):
        tree = ast.parse((PACKAGE / subpackage / "__init__.py").read_text())
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not imports, f"ran_hf.{subpackage} imports at once: {[ast.unparse(node) for node in imports]}"


def imported_closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for imported in GRAPH[todo.pop()] - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


def test_the_kernels_import_no_module_that_attaches_kernels():
    """`kernel_hub` imports `ran_hf.kernels` while a modeling module that attaches kernels is being imported: were any
    kernel to import such a module (or one that imports it), that import would find it half-made."""
    attaching = {module for module in MODULES if "kernel_hub" in GRAPH[module]} | {"kernel_hub"}
    assert {"building_blocks", "cell_scan", "ran_layer"} <= attaching
    for module in MODULES:
        if module.split(".")[0] == "kernels":
            reached = imported_closure(module) & attaching
            assert not reached, f"{module} imports {sorted(reached)}, which attach kernels"


def test_the_model_reaches_the_kernels_only_through_the_guarded_import_of_kernel_hub():
    """No modeling module imports `ran_hf.kernels` relatively (a saved folder has no such folder); `kernel_hub` imports
    it absolutely, inside a `try` (which Transformers' `check_imports` skips), and nothing else does."""
    importers = {}
    for module in FLAT:
        tree = ast.parse(SOURCES[module].read_text())
        guarded = {id(node) for tries in ast.walk(tree) if isinstance(tries, ast.Try) for node in ast.walk(tries)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[:2] == ["ran_hf", "kernels"]:
                importers[module] = id(node) in guarded
    assert importers == {"kernel_hub": True}

"""The package's import structure, read from its source (no imports run): the layers of ``docs/architecture.md``.

Every import counts, including those under ``TYPE_CHECKING`` and inside functions: a type hint that imports back is
still a circle a reader has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zero"

# The engine's layers, lowest first: a module imports only from its own folder or from a lower layer.
ENGINE_LAYERS = {
    "errors": 0,
    "io": 1,
    "comm": 1,
    "core": 2,
    "schedule": 3,
    "meta": 3,
    "hf": 3,
    "model": 4,
    "sharded_model": 5,
    "full_state": 3,
    "free_memory": 1,
    "checkpoint": 6,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (``from pkg import module`` counts as the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("lightning_zero"):
                found.add(name)
    found.discard(_module_name(path))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # A package's __init__ re-exports from its modules: not a dependency of the modules on the package.
    return {
        name: {m for m in _imports(path, modules) if not name.startswith(m + ".")} for name, path in modules.items()
    }


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add((node.module or "").split(".")[0])
    return roots


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _graph()
    # Tarjan's strongly connected components: any component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_engine_imports_no_lightning() -> None:
    files = sorted((PACKAGE / "engine").rglob("*.py"))
    assert len(files) >= 30
    for path in files:
        roots = _imported_roots(path)
        assert not {"lightning", "pytorch_lightning", "lightning_fabric"} & roots, f"{path} imports {roots}"


def _engine_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engine" else None


def test_engine_layers_import_only_downwards() -> None:
    graph = _graph()
    engine = [m for m in graph if _engine_part(m) is not None]
    assert {_engine_part(m) for m in engine} == set(ENGINE_LAYERS), "a new engine folder needs a layer here"
    wrong = []
    for module in engine:
        part = _engine_part(module)
        for imported in graph[module]:
            other = _engine_part(imported)
            if other is None:
                if imported != "lightning_zero.engine":
                    wrong.append(f"{module} imports {imported} (outside the engine)")
                else:
                    wrong.append(f"{module} imports the engine's __init__ (import the module itself)")
            elif other != part and ENGINE_LAYERS[other] >= ENGINE_LAYERS[part]:
                wrong.append(
                    f"{module} (layer {ENGINE_LAYERS[part]}) imports {imported} (layer {ENGINE_LAYERS[other]})"
                )
    assert not wrong, "\n".join(wrong)


def test_engine_top_holds_a_handful_of_modules() -> None:
    top = sorted(p.name for p in (PACKAGE / "engine").glob("*.py"))
    assert len(top) <= 5, top


@pytest.mark.parametrize(
    ("door", "other"),
    [("lightning_zero.fabric", "lightning_zero.strategies"), ("lightning_zero.strategies", "lightning_zero.fabric")],
)
def test_one_front_door_imports_nothing_from_the_other(door: str, other: str) -> None:
    graph = _graph()
    crossing = [
        f"{module} imports {imported}"
        for module, imported_set in graph.items()
        if module == door or module.startswith(door + ".")
        for imported in imported_set
        if imported == other or imported.startswith(other + ".")
    ]
    assert not crossing, "\n".join(crossing)


def test_the_driver_knows_neither_door() -> None:
    graph = _graph()
    crossing = [
        f"{module} imports {imported}"
        for module, imported_set in graph.items()
        if module.startswith("lightning_zero.driver")
        for imported in imported_set
        if imported.startswith(("lightning_zero.fabric", "lightning_zero.strategies"))
    ]
    assert not crossing, "\n".join(crossing)
    for path in (PACKAGE / "driver").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("lightning.pytorch"), f"{path.name} imports {node.module}"


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_planning_imports_only_the_engine_and_itself() -> None:
    """Planning (the estimator, its report, the activation profile) sits below the doors: a door may import it, it
    imports no door, no driver and no tool."""
    graph = _graph()
    planning = [m for m in graph if _inside(m, "lightning_zero.planning")]
    assert planning, "lightning_zero/planning/ has no modules"
    wrong = [
        f"{module} imports {imported}"
        for module in planning
        for imported in graph[module]
        if not _inside(imported, "lightning_zero.planning") and not _inside(imported, "lightning_zero.engine")
    ]
    assert not wrong, "\n".join(wrong)


def test_only_the_package_entry_points_import_the_tools() -> None:
    """The run tools (parity, dry run, processes) sit above the doors: they may import anything, and nothing in the
    package imports them but its ``__init__`` and ``__main__``."""
    graph = _graph()
    assert any(_inside(m, "lightning_zero.tools") for m in graph), "lightning_zero/tools/ has no modules"
    allowed = {"lightning_zero", "lightning_zero.__main__"}
    wrong = [
        f"{module} imports {imported}"
        for module, imported_set in graph.items()
        if module not in allowed and not _inside(module, "lightning_zero.tools")
        for imported in imported_set
        if _inside(imported, "lightning_zero.tools")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_package_top_holds_only_its_entry_points() -> None:
    """Everything else lives in a folder that shows its place: the engine, the driver, the doors, planning, tools."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "pretrained.py"], top


def test_no_package_file_is_past_500_lines() -> None:
    """Files stay small enough to read in one sitting (docs/architecture.md: one idea each, rarely past ~400)."""
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long

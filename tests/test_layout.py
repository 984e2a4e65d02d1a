"""The dependency direction of docs/architecture.md, read from the source's import statements.

Every import counts, those inside functions too: a lazy import does not make a cycle go away.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipelines", "assets", "resources", "txn_engine")  # highest first
TXN_ENGINE_LAYERS = ("core", "storage", "log", "buffer", "snapshots", "tier", "producers", "sql")  # lowest first


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports (`from a.b import c` counts `a.b.c` when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n for n in submodules if n in modules] or [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def rank(module: str) -> tuple[int, int]:
    """(package rank, layer rank): an import may only go to an equal or lower rank."""
    package, _, rest = module.partition(".")
    package_rank = len(PACKAGES) - PACKAGES.index(package)
    if package != "txn_engine" or not rest:
        return package_rank, 0
    layer = rest.split(".")[0]
    if layer == "reference":  # the oracle sits beside the layers; its own test bounds what it reads
        return package_rank, len(TXN_ENGINE_LAYERS) + 1
    return package_rank, TXN_ENGINE_LAYERS.index(layer) + 1 if layer in TXN_ENGINE_LAYERS else 0


def test_every_txn_engine_module_lives_in_a_layer() -> None:
    loose = [m for m in project_modules() if m.count(".") == 1 and m.startswith("txn_engine.")
             and m.split(".")[1] not in TXN_ENGINE_LAYERS + ("reference",)]
    assert loose == []


def test_imports_point_down() -> None:
    upward = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps if rank(d) > rank(m))
    assert upward == [], "imports that point up the layers:\n" + "\n".join(upward)


def test_production_code_never_imports_the_reference() -> None:
    offenders = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
                       if d.startswith("txn_engine.reference") and not m.startswith("txn_engine.reference"))
    assert offenders == []


def test_reference_reads_only_core_and_the_snapshot_format() -> None:
    allowed = ("txn_engine.core", "txn_engine.reference", "txn_engine.snapshots.format")
    outside = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if m.startswith("txn_engine.reference")
                     for d in deps if not d.startswith(allowed))
    assert outside == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_graph_reader_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from txn_engine.core import errors\n")
    assert imports_of(source, project_modules()) == {"txn_engine.core.errors"}

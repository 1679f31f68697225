"""The scheduler package's layers, read from its import statements (those under TYPE_CHECKING
too): its modules import each other in one direction only, and none imports torch, the worker or
the gateway (the scheduler process is CPU-only and knows the other processes by their messages)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "scheduler"
FORBIDDEN = ("torch", "worker", "gateway")


def imports() -> dict[str, set[str]]:
    """Each scheduler module's imported modules, as dotted names."""
    out = {}
    for path in sorted(PACKAGE.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        out[path.stem] = names
    return out


def test_scheduler_modules_import_each_other_without_a_cycle():
    graph = {m: {n.split(".")[1] for n in names if n.startswith("scheduler.")} & set(imports())
             for m, names in imports().items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        cycle = path[path.index(module):] + [module] if module in path else []
        assert not cycle, "import cycle: " + " -> ".join(cycle)
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, path + [module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_the_scheduler_imports_no_torch_worker_or_gateway():
    for module, names in imports().items():
        bad = sorted(n for n in names if n.split(".")[0] in FORBIDDEN)
        assert not bad, f"scheduler/{module}.py imports {bad}"

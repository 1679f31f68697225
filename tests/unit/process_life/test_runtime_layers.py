"""The processes (gateway, scheduler, worker) and the code they share (runtime, proto,
structured) never import the launcher above them, and runtime imports no process: shared
runtime code lives below what runs it. Read from the import statements."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROCESSES = ("gateway", "scheduler", "worker")
BELOW = ("process_life", "proto", "structured")


def imported(package: str) -> dict[str, set[str]]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


def test_no_process_or_shared_package_imports_the_launcher():
    bad = {path: "launch" for package in PROCESSES + BELOW
           for path, names in imported(package).items() if "launch" in names}
    assert not bad, f"these import launch/: {sorted(bad)}"


def test_runtime_imports_no_process():
    bad = {path: sorted(names & {*PROCESSES, "launch"}) for path, names in imported("process_life").items()
           if names & {*PROCESSES, "launch"}}
    assert not bad, bad

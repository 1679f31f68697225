"""The whole repository's import layers, against the two lines of README.md that draw them, and
its import cycles. Read from every import statement of every module: those inside functions and
under TYPE_CHECKING count as much as those at the top, since any of them runs sooner or later."""
from __future__ import annotations

import ast
import functools
import os
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = ("gateway", "scheduler", "worker")
# Top-level names that well-known packages own: none of ours may be imported under them
# (Hugging Face's `kernels` is imported by transformers when it is installed).
OWNED_ELSEWHERE = ("kernels",)


def drawn_layers() -> list[list[str]]:
    """README's layer line, top to bottom: the packages of each layer."""
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("Layers"))
    return [re.findall(r"`(\w+)/`", layer) for layer in line.split(":", 1)[1].split("→")]


def package_folders() -> set[str]:
    """The folder of each package pyproject.toml installs (pagoda.kernels: kernels/)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    where = setuptools.get("package-dir", {})
    return {where.get(p, p).split(".")[0] for p in setuptools["packages"]}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pagoda", *parts] if parts[0] == "kernels" else parts)


def package_of(name: str) -> str:
    """The folder an import name lives in: pagoda.kernels.x in kernels/, pagoda.x in pagoda/."""
    parts = name.split(".")
    return "kernels" if parts[:2] == ["pagoda", "kernels"] else parts[0]


@functools.cache  # each file parsed once for all the tests
def imports(path: Path) -> list[tuple[int, str]]:
    """(line, name) for every name the file imports: `import a.b` gives a.b, `from a import b` a.b."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the module's own package
                package = module_name(path).split(".")
                package = package if path.name == "__init__.py" else package[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def refusals(paths, refused) -> str:
    """One line per import statement of paths that refused(importing module, name) refuses."""
    lines = {}
    for path in paths:
        for line, name in imports(path):
            if refused(module_name(path), name):
                lines.setdefault((path, line), f"{path.relative_to(ROOT)}:{line} imports {name}")
    return "\n".join(lines.values())


def every_python_file() -> list[Path]:
    """The repository's own: no hidden folder (.venv, .git, .cache), no cache."""
    out = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d != "__pycache__")
        out += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return out


def layered_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in sorted(package_folders())
            for p in sorted((ROOT / folder).rglob("*.py"))}


def test_readme_draws_every_installed_package_in_one_layer():
    drawn = [p for layer in drawn_layers() for p in layer]
    assert len(drawn) == len(set(drawn)), drawn
    assert sorted(drawn) == sorted(package_folders())


def test_each_package_imports_only_from_the_layers_below_its_own():
    layer = {p: i for i, packages in enumerate(drawn_layers()) for p in packages}

    def refused(module: str, name: str) -> bool:
        own, other = package_of(module), package_of(name)
        return other in layer and other != own and layer[other] <= layer[own]
    assert not (bad := refusals(layered_modules().values(), refused)), bad


def test_no_package_imports_the_tests_or_the_benchmarks():
    bad = refusals(layered_modules().values(), lambda _, name: name.split(".")[0] in ("tests", "bench"))
    assert not bad, bad


def test_the_launcher_imports_of_the_processes_only_their_flags():
    """It starts them by module name (python -m worker.main), and routes and checks their flags."""
    bad = refusals(sorted((ROOT / "launch").rglob("*.py")),
                   lambda _, name: name.split(".")[0] in PROCESSES
                   and not re.fullmatch(r"(gateway|scheduler|worker)\.\w+_flags(\.\w+)?", name))
    assert not bad, bad


def test_the_scheduler_never_imports_torch_nor_the_kernels_transformers():
    """The scheduler is CPU-only; the kernels know no model."""
    banned = {"scheduler": "torch", "kernels": "transformers"}
    bad = refusals([p for folder in banned for p in sorted((ROOT / folder).rglob("*.py"))],
                   lambda module, name: name.split(".")[0] == banned[package_of(module)])
    assert not bad, bad


def test_nothing_is_imported_under_a_name_another_package_owns():
    """Anywhere in the repository, tests and benchmarks included: an import of kernels/ by the
    top-level name works from the checkout's root (a folder on the path), then fails beside
    Hugging Face's `kernels`."""
    bad = refusals(every_python_file(), lambda _, name: name.split(".")[0] in OWNED_ELSEWHERE)
    assert not bad, bad


def test_no_import_cycle_between_modules():
    modules = layered_modules()

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: sorted({t for _, name in imports(p) if (t := target(name)) and t != m})
             for m, p in modules.items()}
    done: set[str] = set()
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for dep in graph[module]:
            visit(dep, path + [module])
        done.add(module)

    for module in graph:
        visit(module, [])
    assert not cycles, "\n".join(cycles)

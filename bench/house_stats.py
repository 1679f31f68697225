"""The shape of the tree, for issue 23's "Measure" section: lines per top-level package, the
longest files and functions, and import cycles among the project's own modules.

    .venv/bin/python -m bench.house_stats [DIR] [--top 5]

DIR (default: the current directory) is read as it is on disk; run it on a clean worktree of a
commit to measure that commit (`git worktree add /tmp/wt-x REV`). Stdlib only.

What it counts:
- lines: the non-blank lines of .py files (comments and docstrings count), leaving out generated
  protobuf modules (*_pb2*.py) and .venv, build, hidden and __pycache__ folders. A package is a
  folder directly under DIR with .py files below it; files directly under DIR are "(top level)".
- functions: every def and async def, nested ones and methods included, by
  end_lineno - lineno + 1 (the def line to the last line of its body; decorators not counted).
- import cycles: the graph of imports between the project's modules (the .py files counted
  above, named by their path: tests/unit/<package>/test_<name>.py is
  tests.unit.<package>.test_<name>). Every import statement counts wherever it stands: at
  module level, under `if TYPE_CHECKING:`, inside a function or a try; the cycles are given so,
  then again without the TYPE_CHECKING imports (the ones that can bite at run time).
  `import a.b.c` and `from a.b import c` point at the deepest project module they name (a.b.c
  when it is a module, else a.b); relative imports are resolved against the importing module's
  package. A cycle is a strongly connected component of more than
  one module; a module that imports itself is counted apart.

Prints markdown: one table per figure, then the cycles, each as its modules.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from collections import defaultdict
from pathlib import Path

SKIP_DIRS = {".venv", "venv", "build", "__pycache__", "node_modules"}


def python_files(root: Path) -> list[Path]:
    """Every counted .py file below root, as paths relative to root, sorted."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")
                         and not d.endswith(".egg-info"))
        found += [Path(folder, name).relative_to(root) for name in files
                  if name.endswith(".py") and "_pb2" not in name]
    return sorted(found)


def module_name(rel: Path, root: Path) -> str:
    """The name a file is imported under: its path, except that kernels/ is pagoda.kernels where it
    is no package of its own (pagoda/__init__.py maps the name; a tree before that imports it as
    kernels)."""
    parts = rel.with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if parts[:1] == ("kernels",) and not (root / "kernels" / "__init__.py").exists():
        parts = ("pagoda", *parts)
    return ".".join(parts)


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, first line, length) of every function below tree."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.lineno, node.end_lineno - node.lineno + 1
            yield from functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def imported_names(tree: ast.AST, module: str, is_package: bool):
    """(dotted name, whether under `if TYPE_CHECKING:`) for every import anywhere in the module
    (resolve() maps the names to modules)."""
    package = module if is_package else module.rpartition(".")[0]
    stack = [(tree, False)]
    while stack:
        node, typing = stack.pop()
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
            stack += [(n, True) for n in node.body] + [(n, typing) for n in node.orelse]
            continue
        stack += [(n, typing) for n in ast.iter_child_nodes(node)]
        if isinstance(node, ast.Import):
            yield from ((alias.name, typing) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([base] if base else []))
            yield from ((f"{base}.{a.name}" if base else a.name, typing) for a in node.names)
            if base:
                yield base, typing


def resolve(name: str, modules: set[str]) -> str | None:
    """The deepest project module that name (or a prefix of it) is."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: every strongly connected component of graph."""
    index, low, on_stack, stack, work, components = {}, {}, set(), [], [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        work.append((node, iter(sorted(graph[node]))))

    for start in sorted(graph):
        if start in index:
            continue
        visit(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    visit(nxt)
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    cut = stack.index(node)
                    component, stack[cut:] = stack[cut:], []
                    on_stack.difference_update(component)
                    components.append(sorted(component))
    return components


def report(root: Path, top: int) -> str:
    files = python_files(root)
    lines_by_file, funcs, trees = {}, [], {}
    for rel in files:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        lines_by_file[rel] = sum(1 for line in text.splitlines() if line.strip())
        try:
            trees[rel] = tree = ast.parse(text, filename=str(rel))
        except SyntaxError as exc:  # counted as lines, left out of functions and imports
            print(f"warning: {rel}: {exc}", file=sys.stderr)
            continue
        funcs.extend((length, f"{rel}:{line}", name) for name, line, length in functions(tree))

    packages = defaultdict(lambda: [0, 0])
    for rel, count in lines_by_file.items():
        entry = packages[rel.parts[0] if len(rel.parts) > 1 else "(top level)"]
        entry[0], entry[1] = entry[0] + 1, entry[1] + count
    out = [f"# House statistics: {root.resolve()}", "",
           "## Non-blank lines of Python per top-level package", "",
           "| package | files | lines |", "|---|---|---|"]
    for name, (nfiles, count) in sorted(packages.items(), key=lambda kv: -kv[1][1]):
        out.append(f"| {name} | {nfiles} | {count:,} |")
    out.append(f"| **total** | {len(lines_by_file)} | {sum(lines_by_file.values()):,} |")

    out += ["", f"## The {top} longest files", "", "| file | non-blank lines |", "|---|---|"]
    for rel, count in sorted(lines_by_file.items(), key=lambda kv: (-kv[1], str(kv[0])))[:top]:
        out.append(f"| {rel} | {count:,} |")

    out += ["", f"## The {top} longest functions", "", "| function | where | lines |",
            "|---|---|---|"]
    for length, where, name in sorted(funcs, key=lambda f: (-f[0], f[1]))[:top]:
        out.append(f"| `{name}` | {where} | {length} |")

    modules = {module_name(rel, root): rel for rel in trees}
    graphs = {"Every import": {m: set() for m in modules},
              "Without the TYPE_CHECKING imports": {m: set() for m in modules}}
    for mod, rel in modules.items():
        for name, typing in imported_names(trees[rel], mod, rel.name == "__init__.py"):
            if (target := resolve(name, set(modules))) is not None:
                for graph in list(graphs.values())[:1 if typing else 2]:
                    graph[mod].add(target)
    out += ["", "## Import cycles", "", f"{len(modules)} modules. A cycle is a strongly connected "
            "component of more than one module; module-level and function-local imports count."]
    for label, graph in graphs.items():
        self_loops = sorted(m for m, targets in graph.items() if m in targets)
        for m in self_loops:
            graph[m].discard(m)
        cycles = sorted((c for c in strongly_connected(graph) if len(c) > 1),
                        key=lambda c: (-len(c), c))
        out += ["", f"{label}: {sum(map(len, graph.values()))} import edges, "
                f"**{len(cycles)} cycle(s)** ({sum(map(len, cycles))} modules in them), "
                f"{len(self_loops)} module(s) importing themselves."]
        out += [f"{i}. {len(c)} modules: " + ", ".join(f"`{m}`" for m in c)
                for i, c in enumerate(cycles, 1)]
        out += [f"- imports itself: `{m}`" for m in self_loops]
    return "\n".join(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=".", help="the source tree (default: cwd)")
    parser.add_argument("--top", type=int, default=5, help="how many files and functions")
    args = parser.parse_args()
    print(report(Path(args.root), args.top))

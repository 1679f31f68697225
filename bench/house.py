"""The house, for issue 54's "Measure" section: the figures that say whether the paths that
cross modules have one owner each. For the tree it runs in (or DIR):

    .venv/bin/python -m bench.house [DIR] [--top 10]

Stdlib only, plus the `duplicates` command where it is on PATH. Reads DIR as it is on disk: run
it in a clean worktree of a commit to measure that commit (`git worktree add /tmp/wt-x REV`).
Files: the .py files bench/house_stats.py counts (no generated *_pb2*, .venv, build, hidden or
__pycache__ folders). What each figure counts:

- lines per top-level package: non-blank lines of .py files, comments and docstrings included.
- the longest functions: every def, methods and nested ones included, the def line to the last
  line of its body (ast's end_lineno - lineno + 1), as file:name:lines.
- import cycles: strongly connected components (more than one module) of the graph of imports
  between the repository's modules, every import statement wherever it stands (module level,
  inside a function, under TYPE_CHECKING); bench/house_stats.py's docstring has the rules.
- request progress: per module outside tests/, the statements that write a progress field
  (PROGRESS_FIELDS, or --progress-fields) of any object, matched by the attribute's name: `x.f = ...`, `x.f += ...`,
  `x.f[i] = ...`, `del x.f[...]` and mutating calls `x.f.append(...)` (extend, insert, pop,
  clear, remove, `__setitem__`), also through a local name bound to the field (`tokens =
  req.all_token_ids`, then `tokens.append(t)` or `tokens[i] = t`); and the calls of the progress verbs given with --progress-verbs.
- modules that decide the stream: per module outside tests/, the writes (as above) of the stream
  state (STREAM_WRITTEN) plus the reads of STREAM_TESTED inside a condition (an if, elif,
  while, conditional expression or comprehension filter); a module with either decides. The
  gateway's setting of `final_only` on the AddRequest is the request's spec, not a decision,
  and is not counted (final_only is tested, not written, in the list).
- duplicated code: `duplicates --most 200` (the pairs of places sharing six or more identical
  or same-shape lines: its own help says how); and, needing nothing, EXACT runs: every window of
  DUP_WINDOW consecutive normalized lines (stripped, white space folded; blank, comment-only,
  lone-punctuation and import lines dropped) hashed; two places sharing a window, neither
  overlapping the other, form a pair; consecutive shared windows of the same two files merge into
  one run; a window standing in more than 8 places is boilerplate and left out. Pairs = runs.

Prints markdown, one table per figure.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

if not __package__:  # run as bench/house.py: the repository root, for `bench.house_stats`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.house_stats import (functions, imported_names, module_name, python_files,  # noqa: E402
                               resolve, strongly_connected)

# How far a sequence has got (scheduler/request.py); its blocks and prefix-cache counts are its
# placement, not its progress.
PROGRESS_FIELDS = ("num_computed_tokens", "num_pending", "all_token_ids")
STREAM_WRITTEN = ("stream_started", "num_unstreamed", "first_token_time")
STREAM_TESTED = ("final_only", "stream_started", "num_unstreamed")
MUTATORS = {"append", "extend", "insert", "pop", "clear", "remove", "__setitem__"}
DUP_WINDOW = 6
DUP_TOO_COMMON = 8
NOT_CODE = re.compile(r"^(#.*|[()\[\]{}:,;]*|(from\s+\S+\s+)?import\s.*)$")


def field_writes(tree: ast.AST, fields: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, field) of every statement below tree that writes one of fields on any object."""
    aliases = {}  # `tokens = req.all_token_ids` (or `a, b = x.f, 0`), then tokens.append(...)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            pairs = ([(node.targets[0], node.value)] if not isinstance(node.targets[0], ast.Tuple)
                     else zip(node.targets[0].elts, getattr(node.value, "elts", [])))
            aliases.update((t.id, v.attr) for t, v in pairs if isinstance(t, ast.Name)
                           and isinstance(v, ast.Attribute) and v.attr in fields)

    def field_of(target: ast.AST, rebinds: bool) -> str | None:
        """The field target writes: x.f and x.f[i] do; an alias does when it is subscripted,
        mutated or augmented, not when it is only bound again (rebinds)."""
        subscripted = isinstance(target, ast.Subscript)
        while isinstance(target, ast.Subscript):
            target = target.value
        if isinstance(target, ast.Attribute) and target.attr in fields:
            return target.attr
        if isinstance(target, ast.Name) and (subscripted or not rebinds):
            return aliases.get(target.id)
        return None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets
                       for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
            found += [(node.lineno, f) for t in targets if (f := field_of(t, rebinds=True))]
        elif isinstance(node, ast.AnnAssign):
            found += [(node.lineno, f)] if (f := field_of(node.target, rebinds=True)) else []
        elif isinstance(node, ast.AugAssign):
            found += [(node.lineno, f)] if (f := field_of(node.target, rebinds=False)) else []
        elif isinstance(node, ast.Delete):
            found += [(node.lineno, f) for t in node.targets if (f := field_of(t, rebinds=False))]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            found += [(node.lineno, f)] if (f := field_of(node.func.value, rebinds=False)) else []
    return found


def tested_in_conditions(tree: ast.AST, fields: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, field) of every read of fields inside a condition below tree."""
    conditions = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            conditions.append(node.test)
        elif isinstance(node, ast.comprehension):
            conditions += node.ifs
    return sorted({(n.lineno, n.attr) for cond in conditions for n in ast.walk(cond)
                   if isinstance(n, ast.Attribute) and n.attr in fields})


def calls_of(tree: ast.AST, verbs: set[str]) -> list[tuple[int, str]]:
    return [(n.lineno, n.func.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in verbs]


def exact_duplicates(root: Path, files: list[Path]) -> list[tuple[int, str, str]]:
    """(windows shared, 'a.py:L', 'b.py:L') of every run of identical normalized lines."""
    places, lines_of = defaultdict(list), {}
    for rel in files:
        kept = []
        for number, line in enumerate((root / rel).read_text(errors="replace").splitlines(), 1):
            line = " ".join(line.split())
            if line and not NOT_CODE.match(line):
                kept.append((number, line))
        lines_of[rel] = [n for n, _ in kept]
        for i in range(len(kept) - DUP_WINDOW + 1):
            window = "\n".join(text for _, text in kept[i:i + DUP_WINDOW])
            places[hashlib.blake2b(window.encode(), digest_size=12).digest()].append((rel, i))
    shared = set()
    for spots in places.values():
        if 2 <= len(spots) <= DUP_TOO_COMMON:
            for a in range(len(spots)):
                for b in range(a + 1, len(spots)):
                    (fa, ia), (fb, ib) = spots[a], spots[b]
                    if fa != fb or abs(ia - ib) >= DUP_WINDOW:
                        shared.add((fa, ia, fb, ib))
    runs = []
    for fa, ia, fb, ib in shared:
        if (fa, ia - 1, fb, ib - 1) in shared:
            continue  # inside a run that starts earlier
        length = 1
        while (fa, ia + length, fb, ib + length) in shared:
            length += 1
        runs.append((length, f"{fa}:{lines_of[fa][ia]}", f"{fb}:{lines_of[fb][ib]}"))
    return sorted(runs, key=lambda r: (-r[0], r[1], r[2]))


def duplicates_tool(root: Path) -> list[str]:
    """The `duplicates` command's count line and its cut line, or why there are none."""
    if shutil.which("duplicates") is None:
        return ["(`duplicates` is not on PATH here: only the exact count below)"]
    out = subprocess.run(["duplicates", "--repo", str(root), "--most", "200", "--seconds", "300"],
                         capture_output=True, text=True, check=False).stdout.splitlines()
    return [line for i, line in enumerate(out)
            if i == 0 or line.startswith(("(+", "left out:", "incomplete:"))]


def per_module_table(title: str, hits: dict[str, list[tuple[int, str]]]) -> list[str]:
    out = [title, "", "| module | count | fields or verbs (lines) |", "|---|---|---|"]
    for mod, found in sorted(hits.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        by_name = defaultdict(list)
        for line, name in sorted(found):
            by_name[name].append(str(line))
        out.append(f"| {mod} | {len(found)} | "
                   + "; ".join(f"`{n}` {', '.join(ls)}" for n, ls in sorted(by_name.items())) + " |")
    total = sum(map(len, hits.values()))
    return out + [f"| **{len(hits)} modules** | {total} | |"]


def report(root: Path, top: int, progress_fields: tuple[str, ...], progress_verbs: set[str]) -> str:
    files = python_files(root)
    trees, lines = {}, {}
    for rel in files:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        lines[rel] = sum(1 for line in text.splitlines() if line.strip())
        try:
            trees[rel] = ast.parse(text, filename=str(rel))
        except SyntaxError as exc:
            print(f"warning: {rel}: {exc}", file=sys.stderr)
    out = [f"# The house: {root.resolve()}", ""]

    packages = defaultdict(lambda: [0, 0])
    for rel, count in lines.items():
        entry = packages[rel.parts[0] if len(rel.parts) > 1 else "(top level)"]
        entry[0], entry[1] = entry[0] + 1, entry[1] + count
    out += ["## Non-blank lines of Python per top-level package", "",
            "| package | files | lines |", "|---|---|---|"]
    out += [f"| {name} | {n} | {count:,} |"
            for name, (n, count) in sorted(packages.items(), key=lambda kv: -kv[1][1])]
    out += [f"| **total** | {len(lines)} | {sum(lines.values()):,} |", ""]

    funcs = sorted(((length, f"{rel}:{name}", line) for rel, tree in trees.items()
                    for name, line, length in functions(tree)), key=lambda f: (-f[0], f[1]))
    out += [f"## The {top} longest functions", "", "| file:name | starts at | lines |",
            "|---|---|---|"]
    out += [f"| `{where}` | {line} | {length} |" for length, where, line in funcs[:top]] + [""]

    modules = {module_name(rel, root): rel for rel in trees}
    graph = {m: set() for m in modules}
    for mod, rel in modules.items():
        for name, _ in imported_names(trees[rel], mod, rel.name == "__init__.py"):
            if (target := resolve(name, set(modules))) is not None and target != mod:
                graph[mod].add(target)
    cycles = sorted((c for c in strongly_connected(graph) if len(c) > 1), key=lambda c: (-len(c), c))
    out += ["## Import cycles, function-level imports counted", "",
            f"{len(modules)} modules, {sum(map(len, graph.values()))} import edges: "
            f"**{len(cycles)} cycle(s)**."]
    out += [f"{i}. " + ", ".join(f"`{m}`" for m in c) for i, c in enumerate(cycles, 1)] + [""]

    outside_tests = {rel: tree for rel, tree in trees.items() if rel.parts[0] != "tests"}
    progress = {str(rel): hits for rel, tree in outside_tests.items()
                if (hits := field_writes(tree, progress_fields)
                    + calls_of(tree, progress_verbs))}
    out += per_module_table("## Where request progress is written (outside tests/)", progress)
    out += ["", "Fields: " + ", ".join(f"`{f}`" for f in progress_fields)
            + (". Verbs: " + ", ".join(f"`{v}`" for v in sorted(progress_verbs))
               if progress_verbs else ". Verbs: none given (--progress-verbs)") + ".", ""]

    stream = {str(rel): hits for rel, tree in outside_tests.items()
              if (hits := field_writes(tree, STREAM_WRITTEN)
                  + tested_in_conditions(tree, STREAM_TESTED))}
    out += per_module_table("## Modules that decide the stream (outside tests/)", stream)
    out += ["", "Written: " + ", ".join(f"`{f}`" for f in STREAM_WRITTEN) + "; tested in a "
            "condition: " + ", ".join(f"`{f}`" for f in STREAM_TESTED) + ".", ""]

    runs = exact_duplicates(root, files)
    out += ["## Duplicated code", "", "`duplicates --most 200`:", ""]
    out += [f"    {line}" for line in duplicates_tool(root)]
    out += ["", f"Exact runs of {DUP_WINDOW}+ normalized lines: **{len(runs)} pairs** "
            f"({sum(1 for r in runs if 'tests/' in r[1] + r[2])} with a side in tests/); "
            "the longest:", "", "| shared lines | one side | other side |", "|---|---|---|"]
    out += [f"| {n + DUP_WINDOW - 1} | {a} | {b} |" for n, a, b in runs[:top]]
    return "\n".join(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=".", help="the source tree (default: cwd)")
    parser.add_argument("--top", type=int, default=10, help="how many functions and duplicates")
    parser.add_argument("--progress-fields", default=",".join(PROGRESS_FIELDS),
                        help="comma-separated attribute names whose writes count as progress")
    parser.add_argument("--progress-verbs", default="",
                        help="comma-separated method names whose calls count as progress writes "
                             "(the progress object's verbs, once it has them)")
    args = parser.parse_args()
    fields = tuple(f.strip() for f in args.progress_fields.split(",") if f.strip())
    verbs = {v.strip() for v in args.progress_verbs.split(",") if v.strip()}
    print(report(Path(args.root), args.top, fields, verbs))

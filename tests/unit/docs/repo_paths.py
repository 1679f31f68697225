"""Finds the repository paths that the documents and the code's comments name, so that a test
can say which of them point at nothing.

A path is a word that starts with one of the repository's top-level folders and a slash
(`kernels/csrc/cpu_gemm.c`, `scheduler/`, `deploy/k8s/`); a path of a file outside the
repository (`/tmp/x.json`, `transformers/models/...`, `.venv/bin/python`) does not start so and is
not one. A word is what stands between spaces, backticks and brackets, with the punctuation
around it, a `:line`, `:name` or `#anchor` after it, and a leading `./` taken off. A word with a
`*` is a glob and must match something; one with `<`, `{`, `...` or `$` is a template and is not
checked. Where they are read:

- the tracked .md files (README.md, docs/, kernels/TUNING.md): the words inside inline code and
  fenced blocks (paths in prose links are checked by test_docs.py's link test).
  docs/benchmarks-history.md is left out: it records runs of trees that no longer exist, in
  those trees' words.
- the tracked .py files: every word of every # comment and of every docstring (module, class,
  function), backticked or not, since comments name files bare; the tracked .c and .h files:
  every word of every // and /* */ comment.
"""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HISTORY = "docs/benchmarks-history.md"
WORD_SPLIT = re.compile(r"[\s`()\[\]{}<>\"',;=|]+")
TEMPLATE = re.compile(r"[<{$]|\.\.\.")
TRAILING = re.compile(r"(#.*|:[\w.:-]*)$")
C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


@dataclass(frozen=True)
class Mention:
    file: str    # relative to the repository's root
    line: int
    path: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}"


def tracked_files(root: Path = ROOT) -> list[str]:
    """The files git tracks, or, outside a checkout, every file below root."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True,
                             text=True, check=True).stdout.split("\n")
        return [f for f in out if f and (root / f).exists()]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                and ".venv" not in p.parts and ".git" not in p.parts]


def top_level_folders(files: list[str]) -> set[str]:
    return {f.split("/", 1)[0] for f in files if "/" in f and not f.startswith(".")}


def paths_in(text: str, folders: set[str]) -> Iterator[str]:
    """The words of text that are repository paths (see the module's docstring)."""
    for word in WORD_SPLIT.split(text):
        word = TRAILING.sub("", word.strip(".,;:!?*_")) if "*" not in word else word.strip(".,;:!?")
        word = word.removeprefix("./")
        if "/" not in word or word.split("/", 1)[0] not in folders or TEMPLATE.search(word):
            continue
        yield word


def exists(path: str, root: Path = ROOT) -> bool:
    if "*" in path:
        return any(root.glob(path.rstrip("/")))
    return (root / path).exists()


def markdown_mentions(rel: str, folders: set[str], root: Path = ROOT) -> Iterator[Mention]:
    """Paths inside inline code and fenced blocks of one markdown file."""
    fenced = False
    for number, line in enumerate((root / rel).read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        spans = [line] if fenced else re.findall(r"`([^`\n]+)`", line)
        for span in spans:
            yield from (Mention(rel, number, p) for p in paths_in(span, folders))


def python_mentions(rel: str, folders: set[str], root: Path = ROOT) -> Iterator[Mention]:
    """Paths in the # comments and docstrings of one .py file."""
    source = (root / rel).read_text(errors="replace")
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                yield from (Mention(rel, tok.start[0], p) for p in paths_in(tok.string, folders))
        tree = ast.parse(source)
    except (SyntaxError, tokenize.TokenError):
        return  # not Python this interpreter reads: another test says so
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            # The docstring's raw lines, so that line numbers match the file's.
            lines = source.splitlines()[first.lineno - 1:first.end_lineno]
            for offset, line in enumerate(lines):
                yield from (Mention(rel, first.lineno + offset, p) for p in paths_in(line, folders))


def c_mentions(rel: str, folders: set[str], root: Path = ROOT) -> Iterator[Mention]:
    """Paths in the // and /* */ comments of one C source or header."""
    source = (root / rel).read_text(errors="replace")
    for comment in C_COMMENT.finditer(source):
        first = source.count("\n", 0, comment.start()) + 1
        for offset, line in enumerate(comment.group().splitlines()):
            yield from (Mention(rel, first + offset, p) for p in paths_in(line, folders))


def all_mentions(root: Path = ROOT) -> list[Mention]:
    files = tracked_files(root)
    folders = top_level_folders(files)
    found: list[Mention] = []
    for rel in files:
        if rel.endswith(".md") and rel != HISTORY:
            found += markdown_mentions(rel, folders, root)
        elif rel.endswith(".py") and "_pb2" not in rel:
            found += python_mentions(rel, folders, root)
        elif rel.endswith((".c", ".h")):
            found += c_mentions(rel, folders, root)
    return sorted(found, key=lambda m: (m.file, m.line, m.path))


def stale(root: Path = ROOT) -> list[Mention]:
    return [m for m in all_mentions(root) if not exists(m.path, root)]

"""The repository paths that documents and comments name exist, as test_docs.py checks links:
a file moved or renamed leaves no pointer at its old place (which words count: repo_paths.py)."""
from __future__ import annotations

import pytest

from tests.unit.docs import repo_paths


def test_named_repository_paths_exist():
    if missing := repo_paths.stale():
        pytest.fail(f"{len(missing)} named repository path(s) point at nothing; write where the "
                    "file is now (or drop the name):\n" + "\n".join(map(str, missing)),
                    pytrace=False)


def test_the_path_check_sees_paths():
    # Guards the word rules: a check that finds no paths would pass on anything.
    folders = {"kernels", "bench", "docs"}
    sample = ("see `kernels/csrc/cpu_gemm.c:12`, (bench/offline.py) and `docs/`; "
              "`kernels/cpu_*.c` `tests/unit/<package>/` /tmp/kernels/x.c transformers/x.py "
              "`.venv/bin/python -m bench.offline` docs/api.md#errors.")
    assert list(repo_paths.paths_in(sample, folders)) == [
        "kernels/csrc/cpu_gemm.c", "bench/offline.py", "docs/", "kernels/cpu_*.c", "docs/api.md"]
    assert repo_paths.exists("kernels/csrc/cpu_*.c") and not repo_paths.exists("kernels/cpu_*.c")
    named = {(m.file, m.path) for m in repo_paths.all_mentions()}
    assert ("README.md", "proto/pagoda.proto") in named            # markdown, inline code
    assert ("bench/bench_cpu_attention.py", "kernels/cpu_attention.py") in named  # a .py docstring
    assert ("kernels/csrc/cpu_gemm.c", "bench/bench_gemm.py") in named  # a C comment

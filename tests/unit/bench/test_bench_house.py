"""bench/house.py's counting rules on small sources: what counts as writing request progress,
as deciding the stream, and as a duplicated block."""
from __future__ import annotations

import ast
import textwrap

from bench import house

PROGRESS = ("num_computed_tokens", "num_pending", "all_token_ids")


def tree(source: str) -> ast.AST:
    return ast.parse(textwrap.dedent(source))


def test_progress_writes_are_assignments_mutations_and_aliases_not_reads():
    found = house.field_writes(tree("""
        req.num_computed_tokens = 3          # 2
        req.num_pending += 1                 # 3
        seq.all_token_ids.append(7)          # 4
        tokens, kept = req.all_token_ids, 0  # 5: an alias, not a write
        tokens.append(8)                     # 6
        tokens[0] = 1                        # 7
        n = req.num_computed_tokens + 1      # 8: a read
        if req.num_pending: pass             # 9: a read
        del req.all_token_ids[-1:]           # 10
        other = [1]; other.append(2)         # 11: not a field
        """), PROGRESS)
    assert sorted(found) == [(2, "num_computed_tokens"), (3, "num_pending"), (4, "all_token_ids"),
                             (6, "all_token_ids"), (7, "all_token_ids"), (10, "all_token_ids")]


def test_the_stream_is_decided_by_conditions_on_its_state_not_by_other_reads():
    source = tree("""
        if req.final_only and x:             # 2
            req.num_unstreamed += 1          # 3
        y = 1 if req.stream_started else 2   # 4
        first = not req.stream_started       # 5: a read outside a condition
        add.final_only = True                # 6: the spec, not the stream state
        """)
    assert house.tested_in_conditions(source, house.STREAM_TESTED) == [
        (2, "final_only"), (4, "stream_started")]
    assert house.field_writes(source, house.STREAM_WRITTEN) == [(3, "num_unstreamed")]


def test_exact_duplicates_pair_runs_of_six_normalized_lines(tmp_path):
    body = "\n".join(f"    total = total + {i}  # step {i}" for i in range(8))
    (tmp_path / "a.py").write_text(f"import os\n\ndef f(total):\n{body}\n    return total\n")
    (tmp_path / "b.py").write_text(f"def g(total):\n\n{body}\n    return total * 2\n")
    (tmp_path / "c.py").write_text("\n".join(f"x{i} = {i}" for i in range(5)) + "\n")
    runs = house.exact_duplicates(tmp_path, [tmp_path.joinpath(n).relative_to(tmp_path)
                                            for n in ("a.py", "b.py", "c.py")])
    # The 8 shared body lines make 3 windows of 6, one run; `def` lines and returns differ.
    assert runs == [(3, "a.py:4", "b.py:3")]


def test_the_report_finds_an_import_cycle_in_a_small_tree(tmp_path, monkeypatch):
    # The whole report on a tree of two packages that import each other inside functions.
    monkeypatch.setattr(house, "duplicates_tool", lambda root: [])  # the tool is not the point
    for name, other in (("alpha", "beta"), ("beta", "alpha")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "core.py").write_text(f"def f():\n    from {other} import core\n")
    text = house.report(tmp_path, 10, PROGRESS, set())
    assert "**1 cycle(s)**.\n1. `alpha.core`, `beta.core`" in text

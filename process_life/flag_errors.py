"""Flags a process cannot run with. Such a process says which flag and why in one line and exits
with argparse's own code, 2; the launcher stops everything when a child exits 2 rather than
restart, forever, a process that can never start (launch/children.py). The launcher checks
what it can before it starts anything (launch/flag_routing.py check_flags)."""
from __future__ import annotations

import sys

BAD_FLAGS = 2


class FlagError(SystemExit):
    """Raised where a flag's value is found wrong deep in a start-up (a model that is not there,
    a draft of another vocabulary). A SystemExit, so that no `except Exception` swallows it,
    with code 2; each process's `__main__` prints it (main_refusing)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = BAD_FLAGS


def main_refusing(main) -> int:
    """main()'s exit code, or BAD_FLAGS after a FlagError's message on stderr (one line, no
    traceback: the flag is wrong, not the code)."""
    try:
        return main()
    except FlagError as e:
        print(f"pagoda: {e}", file=sys.stderr, flush=True)
        return BAD_FLAGS

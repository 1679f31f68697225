"""Flags a process cannot run with. Such a process says which flag and why in one line and exits
with argparse's own code, 2; the launcher stops everything when a child exits 2 rather than
restart, forever, a process that can never start (launch/children.py). The launcher checks
what it can before it starts anything (launch/stack.py preflight)."""
from __future__ import annotations

import sys
from typing import NoReturn

BAD_FLAGS = 2


def refuse(message: str) -> NoReturn:
    """Exit 2 with message on stderr (no traceback: the flag is wrong, not the code)."""
    print(f"pagoda: {message}", file=sys.stderr, flush=True)
    raise SystemExit(BAD_FLAGS)


class FlagError(SystemExit):
    """Raised where a flag's value is found wrong deep in a start-up (a model that is not there,
    a draft of another vocabulary). A SystemExit, so that no `except Exception` swallows it,
    with code 2; each process's `__main__` prints it (main_refusing)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = BAD_FLAGS


def main_refusing(main) -> int:
    """main()'s exit code, or refuse() with a FlagError's message."""
    try:
        return main()
    except FlagError as e:
        refuse(str(e))

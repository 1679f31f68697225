"""A stand-in for a pagoda process that dies at once, every time (`--worker-module
tests.stand_in_crashing`): exit code 3, or PAGODA_STAND_IN_EXIT's. It ignores its flags. With
PAGODA_STAND_IN_LOG set it appends "crashed PID TIME" first, so a test can read the launcher's
backoff off the times."""
from __future__ import annotations

import os
import sys

from tests.stand_in_serving import note

if __name__ == "__main__":
    note("crashed")
    sys.exit(int(os.environ.get("PAGODA_STAND_IN_EXIT", "3")))

"""Measurements a worker makes of its machine at start-up, kept for the next start: the CPU
kernels' row bounds (worker/model/cpu_matmul.py), the one-C-call decode step's bound and the prefill
rate the scheduler's deadlines use (worker/startup/measurements.py). Each kind is one JSON file in
PAGODA_MEASUREMENTS, else the cache folder (PAGODA_CACHE, else ~/.cache/pagoda), keyed by what
the figure depends on; delete the file to measure again. The test suite keeps its own
(tests/conftest.py): a figure timed while tests load the machine must not steer a later `make run`.

Workers starting together on a machine take turns (a lock beside the file): one measures, the
others read its answer, and nobody times the others' load. A folder that cannot be written
costs the next start a measurement, never a start."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from modelfiles.resolve import cache_root

logger = logging.getLogger(__name__)


def machine_key(*parts: object) -> str:
    """The CPU (cpu_identity), torch's version (its BLAS), the thread count, then `parts`."""
    try:
        cpu = cpu_identity(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = ""
    cpu = cpu or platform.processor() or platform.machine()
    return "|".join([cpu, torch.__version__, f"threads={torch.get_num_threads()}", *map(str, parts)])


def cpu_identity(cpuinfo: str) -> str:
    """The first CPU of /proc/cpuinfo's text: its model name, family, model and stepping, and a
    digest of its feature flags ("" if it names none). A VM names many Xeons "Intel(R) Xeon(R)
    Processor": keyed by the name alone, bounds measured on an AVX-512 Xeon steered an AMX one
    (pagoda's fp32 kernel kept for 2048-row prefills, where MKL ran 1.3-1.5x faster past 128 rows)."""
    name, ids, flags = "", {}, ""
    for line in cpuinfo.splitlines():
        field, _, value = (p.strip() for p in line.partition(":"))
        if field == "model name" and not name:
            name = value
        elif field in ("cpu family", "model", "stepping") and field not in ids:
            ids[field] = value
        elif field == "flags" and not flags:
            flags = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:12]
        elif not field and (name or ids):  # the first CPU's entry ends at a blank line
            break
    if not (name or ids or flags):
        return ""
    return f"{name} ({'/'.join(ids.values())}, flags {flags})"


def timed(*counts: tuple[int, ...]) -> str:
    """The key part naming the row or sequence counts a measurement times: a figure kept from
    another list of them is measured again, not read back."""
    return "timed=" + "/".join(",".join(map(str, c)) for c in counts)


def how(was_kept: bool, started: float) -> str:
    """How a kept figure was had, for its log line (started: time.perf_counter() before kept())."""
    return ("as measured before on this machine" if was_kept
            else f"measured in {time.perf_counter() - started:.1f} s")


def measurements_root() -> Path:
    """Where the kept measurements live: PAGODA_MEASUREMENTS, else the cache folder."""
    folder = os.environ.get("PAGODA_MEASUREMENTS")
    return Path(folder) if folder else cache_root()


def kept(name: str, key: str, measure: Callable[[], dict], fields: set[str],
         again: bool = False) -> tuple[dict, bool]:
    """(the figures kept under `key` in `name`.json, True), or (measure()'s, False) after keeping
    them. An entry without exactly `fields` (a garbled file, another version's) is measured again,
    and so is every entry with `again` (--measure-again), the new figures replacing it."""
    path = measurements_root() / f"{name}.json"
    with _one_at_a_time(path):
        found = None if again else _read(path).get(key)
        if isinstance(found, dict) and set(found) == fields:
            return found, True
        value, busy = _measured_alone(measure)
        if busy:  # once more: a process that starts beside this one (make run) is done soon
            logger.info("other processes took %.1f CPUs while %s was measured: measuring it again", busy, name)
            value, busy = _measured_alone(measure)
        _write(path, key, value)
        return value, False


# The CPUs other processes may take during a measurement before it is taken again: the launcher
# starts the gateway, its grammar checkers and the worker together, and the worker's first
# measurements, made while they loaded, once kept pagoda's fp32 kernel for 2048-row prefills
# that MKL ran 1.3-1.5x faster past 128 rows (an AMX Xeon, 2 cores).
OTHERS_CPUS = 0.15


def _measured_alone(measure: Callable[[], dict]) -> tuple[dict, float]:
    """measure()'s figures, and the CPUs other processes took meanwhile beyond the ones this
    process leaves free (0 where that is within OTHERS_CPUS, or not known)."""
    before, started = _cpu_seconds(), time.monotonic()
    value = measure()
    after, elapsed = _cpu_seconds(), time.monotonic() - started
    if before is None or after is None or elapsed < 0.5:  # the counters tick every 10 ms
        return value, 0.0
    others = ((after[0] - before[0]) - (after[1] - before[1])) / elapsed
    spare = max(0, (os.cpu_count() or 1) - torch.get_num_threads())
    return value, (others if others - spare > OTHERS_CPUS else 0.0)


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process has run, per /proc/stat; this process's own), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields]
    except (OSError, ValueError):
        return None
    # user .. steal, but idle and iowait (guest time is in user already)
    busy = sum(ticks[:8]) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


@contextlib.contextmanager
def _one_at_a_time(path: Path):
    """An exclusive lock on the file's lock file, where it can be made; else none."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, key: str, value: dict) -> None:
    data = _read(path)
    data[key] = value
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)  # a reader never sees half a file
    except OSError as e:
        logger.info("a start-up measurement is not kept (%s): %s", path, e)
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)

"""Runs C kernels on a CPU this machine lacks: a Linux booted in Bochs, an x86 emulator that
models Sapphire Rapids (AMX, AVX512-BF16, AVX512-FP16) and older Xeons, with
tests/emulated/runner.c as its init process. The calls and their input buffers go in the
initramfs; each call's output comes back in hex on the serial console. Slow (minutes to boot),
so it is a developer's check, not part of `make test`: docs/benchmarks-history.md "Kernels on CPUs
this machine lacks" says how to get a Bochs that can and what it showed.

What the guest needs comes from this machine: a Debian kernel image (its package, unpacked),
ISOLINUX, and the shared libraries the runner and the kernels link (found with ldd)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ISOLINUX = Path("/usr/lib/ISOLINUX/isolinux.bin")
LDLINUX = Path("/usr/lib/syslinux/modules/bios/ldlinux.c32")
BIOS = Path("/usr/share/bochs/BIOS-bochs-latest")
VGABIOS = Path("/usr/share/bochs/VGABIOS-lgpl-latest")
# The kernel's console on the emulated UART. clearcpuid=fsrm: with "fast short rep movsb" the
# kernel's memmove is a bare rep movsb, which Bochs 3.0 gets wrong early in the boot (a runaway
# copy, then page faults forever, right after "Mountpoint-cache hash table entries").
CMDLINE = "console=ttyS0,115200 panic=-1 nokaslr clearcpuid=fsrm quiet loglevel=4"


@dataclass
class Calls:
    """The guest's work: buffers (inputs from a blob, or zeros) and calls of library functions."""
    lines: list[str] = field(default_factory=list)
    blob: bytearray = field(default_factory=bytearray)
    libraries: list[Path] = field(default_factory=list)
    _next_buffer: int = 0

    def library(self, path: Path) -> None:
        """Calls after this one go to `path`'s functions."""
        self.libraries.append(path)
        self.lines.append(f"lib /k/{path.name}")

    def buffer(self, data: bytes | int) -> str:
        """A buffer holding `data`, or that many zero bytes; returns the argument naming it."""
        buf = self._next_buffer
        self._next_buffer += 1
        if isinstance(data, int):
            self.lines.append(f"buf {buf} {data} -1")
        else:
            self.lines.append(f"buf {buf} {len(data)} {len(self.blob)}")
            self.blob += data
        return f"b{buf}"

    def copy(self, buffer: str) -> str:
        """A new buffer holding what `buffer` holds when the guest reaches this line (a call that
        writes its inputs in place gets its own)."""
        buf = self._next_buffer
        self._next_buffer += 1
        self.lines.append(f"copy {buf} {buffer[1:]}")
        return f"b{buf}"

    def pointer(self, buffer: str, at: int, to: str) -> None:
        """Buffer `to`'s address stored at byte `at` of `buffer` (a struct's pointer field)."""
        self.lines.append(f"ptr {buffer[1:]} {at} {to[1:]}")

    def call(self, tag: str, function: str, out: str, *args: int | str) -> None:
        """function(*args); the guest prints buffer `out` afterwards under `tag`."""
        self.lines.append(" ".join(["call", tag, function, out[1:], *map(str, args)]))

    def value(self, tag: str, function: str) -> None:
        """The int that function() returns, under `tag`."""
        self.lines.append(f"value {tag} {function}")


@dataclass
class Result:
    outputs: dict[str, bytes]
    values: dict[str, int]
    console: str
    seconds: float


def shared_libraries(binaries: list[Path]) -> set[Path]:
    """Every library the binaries load (ldd), the dynamic loader included."""
    found: set[Path] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
        found |= {Path(p) for p in re.findall(r"(/\S+)", out)}
    return found


def _cases(root: Path, calls: Calls) -> None:
    """The calls, their buffers and their libraries under root (cases/, k/)."""
    (root / "k").mkdir(parents=True)
    for lib in calls.libraries:
        shutil.copy(lib, root / "k" / lib.name)
    (root / "cases").mkdir()
    (root / "cases/spec").write_text("\n".join(calls.lines) + "\n")
    (root / "cases/blob").write_bytes(bytes(calls.blob))


def _initramfs(root: Path, runner: Path, calls: Calls) -> None:
    _cases(root, calls)
    (root / "dev").mkdir()
    os.mknod(root / "dev/console", 0o600 | 0o020000, os.makedev(5, 1))
    shutil.copy(runner, root / "init")
    for lib in shared_libraries([runner, *calls.libraries]):
        target = root / str(lib).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(lib.resolve(), target)


def _parse(console: str, seconds: float) -> Result:
    if "@@END" not in console:
        raise RuntimeError(f"the runner did not finish; its output:\n{console[-3000:]}")
    outputs = {m[0]: bytes.fromhex(m[1]) for m in re.findall(r"^@@OUT (\S+) ([0-9a-f]*)\r?$", console, re.M)}
    values = {m[0]: int(m[1]) for m in re.findall(r"^@@VALUE (\S+) (-?\d+)\r?$", console, re.M)}
    return Result(outputs, values, console, seconds)


def run_here(calls: Calls) -> Result:
    """The same calls on this machine, the runner a plain process: the harness's own check
    (only the paths this CPU has may be asked for)."""
    with tempfile.TemporaryDirectory(prefix="pagoda-runner-") as work:
        root = Path(work) / "root"
        _cases(root, calls)
        runner = build_runner(Path(work) / "runner")
        started = time.monotonic()
        done = subprocess.run([str(runner)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "RUNNER_ROOT": str(root)})
        return _parse(done.stdout, time.monotonic() - started)


def _iso(work: Path, kernel: Path, root: Path) -> Path:
    iso = work / "iso"
    (iso / "isolinux").mkdir(parents=True)
    shutil.copy(ISOLINUX, iso / "isolinux")
    shutil.copy(LDLINUX, iso / "isolinux")
    shutil.copy(kernel, iso / "vmlinuz")
    files = subprocess.run(["find", "."], cwd=root, capture_output=True, check=True).stdout
    cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files,
                          capture_output=True, check=True).stdout
    (iso / "initrd.gz").write_bytes(subprocess.run(["gzip", "-1"], input=cpio, capture_output=True,
                                                   check=True).stdout)
    (iso / "isolinux/isolinux.cfg").write_text(
        f"DEFAULT t\nPROMPT 0\nTIMEOUT 0\nLABEL t\n  KERNEL /vmlinuz\n  APPEND initrd=/initrd.gz {CMDLINE}\n")
    out = work / "t.iso"
    subprocess.run(["xorriso", "-as", "mkisofs", "-quiet", "-o", str(out), "-b", "isolinux/isolinux.bin",
                    "-c", "isolinux/boot.cat", "-no-emul-boot", "-boot-load-size", "4", "-boot-info-table",
                    str(iso)], check=True, capture_output=True)
    return out


def build_runner(out: Path) -> Path:
    # libm linked whatever the runner uses: a kernel library may leave its math functions to
    # the process (Python has libm loaded; the runner otherwise would not)
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(out), str(HERE / "runner.c"), "-ldl",
                    "-Wl,--no-as-needed", "-lm"], check=True)
    return out


def run(calls: Calls, bochs: Path, kernel: Path, model: str = "sapphire_rapids",
        timeout: float = 1800.0, keep: Path | None = None) -> Result:
    """Boots `kernel` in Bochs as `model` with the runner as init and `calls` for it to make."""
    work = Path(tempfile.mkdtemp(prefix="pagoda-bochs-", dir=keep))
    try:
        root = work / "root"
        _initramfs(root, build_runner(work / "runner"), calls)
        iso = _iso(work, kernel, root)
        serial = work / "serial.out"
        (work / "bochsrc").write_text(
            f"cpu: model={model}, count=1, ips=100000000\nmemory: guest=2048, host=2048\n"
            f"romimage: file={BIOS}\nvgaromimage: file={VGABIOS}\n"
            f"ata0-master: type=cdrom, path={iso}, status=inserted\nboot: cdrom\n"
            f"com1: enabled=1, mode=file, dev={serial}\ndisplay_library: nogui\n"
            f"log: {work / 'bochs.log'}\npanic: action=fatal\nerror: action=ignore\ninfo: action=ignore\n"
            "clock: sync=none, time0=local\n")
        started = time.monotonic()
        proc = subprocess.Popen([str(bochs), "-q", "-f", str(work / "bochsrc")], cwd=work,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while time.monotonic() - started < timeout and proc.poll() is None:
                if serial.exists() and re.search(r"@@END -?\d+\n", serial.read_text(errors="replace")):
                    break
                time.sleep(1)
        finally:
            proc.kill()
            proc.wait()
        console = serial.read_text(errors="replace") if serial.exists() else ""
        return _parse(console, time.monotonic() - started)
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)

"""worker/startup/kept.py: a machine's measurements are keyed by more of its CPU than the model name,
which a VM gives many Xeon generations alike, and one disturbed by other processes is taken again."""
from __future__ import annotations

from worker.startup.kept import cpu_identity, machine_key

ENTRY = """processor\t: {n}
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 8
flags\t\t: fpu sse2 avx2 avx512f avx512bw amx_tile amx_bf16
"""
SPR = "\n".join(ENTRY.format(n=n) for n in range(2))  # two CPUs, a blank line between
ICX = SPR.replace("143", "106").replace("stepping\t: 8", "stepping\t: 6").replace(" amx_tile amx_bf16", "")


def test_the_same_name_with_other_flags_or_model_is_another_cpu():
    assert cpu_identity(SPR).startswith("Intel(R) Xeon(R) Processor (6/143/8, flags ")
    assert cpu_identity(ICX).startswith("Intel(R) Xeon(R) Processor (6/106/6, flags ")
    assert cpu_identity(SPR) != cpu_identity(ICX)
    assert cpu_identity(SPR.replace(" amx_tile amx_bf16", "")) != cpu_identity(SPR)  # flags alone


def test_the_identity_is_the_first_cpus_and_ignores_the_flags_order():
    shuffled = SPR.replace("fpu sse2 avx2 avx512f avx512bw amx_tile amx_bf16",
                           "amx_bf16 avx2 fpu amx_tile sse2 avx512bw avx512f")
    assert cpu_identity(shuffled) == cpu_identity(SPR)
    mixed = SPR.split("\n\n")[0] + "\n\n" + ICX.split("\n\n")[1]
    assert cpu_identity(mixed) == cpu_identity(SPR)
    assert cpu_identity("") == ""


def test_this_machines_key_names_its_cpu_then_the_parts():
    key = machine_key("shape=1x2")
    assert key.endswith("|shape=1x2") and "|threads=" in key and "flags " in key.split("|")[0]


def test_a_figure_measured_while_others_took_the_cpus_is_measured_again(tmp_path, monkeypatch):
    """The launcher starts the gateway and its grammar checkers beside the worker: a measurement
    they disturbed is taken once more, and the second figure is kept."""
    from worker.startup import kept as kept_module
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path))
    clock = iter([0.0, 1.0, 1.0, 2.0])  # monotonic: each measurement takes a second
    monkeypatch.setattr(kept_module.time, "monotonic", lambda: next(clock))
    # every process's CPU seconds, this one's: 2 CPUs busy in the first second, 0.5 of them others'
    # beyond this process's own 1.5; the second second this process's 1.9 alone
    cpu = iter([(0.0, 0.0), (2.0, 0.0), (2.0, 0.0), (3.9, 1.9)])
    monkeypatch.setattr(kept_module, "_cpu_seconds", lambda: next(cpu))
    monkeypatch.setattr(kept_module.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kept_module.torch, "get_num_threads", lambda: 2)
    figures = iter([{"rows": 1024}, {"rows": 64}])
    calls = []

    def measure():
        calls.append(1)
        return next(figures)

    value, was_kept = kept_module.kept("m", "key", measure, {"rows"})
    assert (value, was_kept, len(calls)) == ({"rows": 64}, False, 2)
    assert kept_module.kept("m", "key", measure, {"rows"}) == ({"rows": 64}, True)


def test_a_quiet_measurement_is_taken_once(tmp_path, monkeypatch):
    from worker.startup import kept as kept_module
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path))
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(kept_module.time, "monotonic", lambda: next(clock))
    cpu = iter([(0.0, 0.0), (2.1, 1.98)])  # others: 0.12 of a CPU, within the allowance
    monkeypatch.setattr(kept_module, "_cpu_seconds", lambda: next(cpu))
    monkeypatch.setattr(kept_module.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kept_module.torch, "get_num_threads", lambda: 2)
    calls = []
    value, _ = kept_module.kept("m", "key", lambda: calls.append(1) or {"rows": 8}, {"rows"})
    assert value == {"rows": 8} and len(calls) == 1

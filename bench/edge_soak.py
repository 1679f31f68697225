"""The edge soak of issue 53 (not in the suite): mixed legitimate traffic from locust (two
tenants; gRPC and HTTP; streamed and unary; structured and plain: bench/edge_soak_users.py)
against a stack started as `make run` starts it, with --api-key A and B, while a hostile client
(bench/edge_attacks.py, a process of its own holding tenant A's key) cycles through every attack
of the issue. Three phases: a baseline (legitimate traffic only), the attacks, and an after.

    .venv/bin/python -m bench.edge_soak --minutes 30 --out /tmp/soak            # the real model
    .venv/bin/python -m bench.edge_soak --minutes 3 --fake-worker --out /tmp/soak  # a quick run

locust is a bench-only tool, not a dependency of pagoda or of its tests:
`.venv/bin/python -m pip install locust==2.47.0` (it pulls in gevent).

Writes soak.json (everything, every sample) and soak.md (the tables) under --out, with the
stack's log (stack.log) and the attacker's (attacks.log): legitimate requests served and refused
by cause per phase and tenant, their p50/p99 latency (send to last byte; streams' first token
too), each attack's outcomes and what a keyed bystander saw while it held, health probes (gRPC
Health/Check and HTTP /health from fresh connections, every second; late past 1 s), the RSS of
every process over time, and whether any process restarted (pids per role, and the launcher's
own "restarting" lines).
"""
from __future__ import annotations

from locust import events  # first: it patches the standard library for gevent
from locust.env import Environment

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import gevent
import grpc
import numpy as np
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import edge_soak_users as users
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import ROOT, Cluster

KEYS = ("soak-tenant-a-key", "soak-tenant-b-key")
FAKE = ("--worker-module", "tests.fake_worker_main", "--num-gpu-blocks-override", "20000")
FAKE_STEP_S = "0.02"  # a fake step as long as a small model's: streams last long enough to be hit
ROLES = ("launcher", "scheduler", "gateway", "worker", "gateway child")
MB = 1 << 20


def processes(launcher: int) -> dict[str, list[int]]:
    """The launcher's processes by role, from /proc: its children and the gateway's."""
    parent, cmd = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    roles: dict[str, list[int]] = {role: [] for role in ROLES}
    roles["launcher"] = [launcher]
    for pid, ppid in parent.items():
        if ppid == launcher:
            role = ("scheduler" if "scheduler.main" in cmd[pid] else "gateway" if "gateway.main" in cmd[pid]
                    else "worker")
            roles[role].append(pid)
    roles["gateway child"] = [pid for pid, ppid in parent.items() if ppid in roles["gateway"]]
    return {role: sorted(pids) for role, pids in roles.items()}


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def sample_rss(launcher: int, every: float, samples: list) -> None:
    while True:
        roles = processes(launcher)
        samples.append({"t": time.time(), "pids": roles,
                        "rss_mb": {role: sum(filter(None, map(rss_mb, pids))) for role, pids in roles.items()}})
        gevent.sleep(every)


def probe_health(grpc_target: str, http_target: str, probes: list) -> None:
    """gRPC Health/Check and HTTP /health, each from a fresh connection, as a kubelet probes."""
    while True:
        for kind in ("grpc", "http"):
            started = time.monotonic()
            try:
                if kind == "grpc":
                    with grpc.insecure_channel(grpc_target) as ch:
                        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    ok = status == health_pb2.HealthCheckResponse.SERVING
                else:
                    ok = requests.get(f"http://{http_target}/health", timeout=5).status_code == 200
            except (grpc.RpcError, requests.RequestException):
                ok = False
            probes.append({"t": time.time(), "kind": kind, "ok": ok, "s": time.monotonic() - started})
        gevent.sleep(1.0)


def start_stack(opts, log: Path) -> Cluster:
    flags = [*(FAKE if opts.fake_worker else ()), "--api-key", KEYS[0], "--api-key", KEYS[1],
             *shlex.split(opts.pagoda_flags)]
    if opts.fake_worker:
        os.environ.setdefault("PAGODA_FAKE_STEP_S", FAKE_STEP_S)
    return Cluster(*flags, num_workers=opts.workers, log_path=log, lazy_grammar=False).start(timeout=600)


def run(opts) -> dict:
    opts.out.mkdir(parents=True, exist_ok=True)
    cluster = start_stack(opts, opts.out / "stack.log")
    http_target = f"127.0.0.1:{cluster.http_port}"
    legit, probes, samples, marks = [], [], [], {}
    try:
        with grpc.insecure_channel(cluster.target) as ch:
            model = pagoda_pb2_grpc.GenerationStub(ch).GetModelInfo(
                pb.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {KEYS[1]}"),), timeout=30).model
        users.configure(cluster.target, http_target, list(KEYS), model, opts.max_tokens, chat=not opts.fake_worker)

        def on_request(request_type, name, response_time, response_length, exception, context, **_):
            legit.append({"t": time.time(), "tenant": context["tenant"], "protocol": request_type,
                          "kind": context["kind"], "ms": response_time, "ttft_ms": context["ttft_ms"],
                          "cause": None if exception is None else str(exception), "detail": context["detail"]})
        env = Environment(user_classes=users.USERS, events=events)
        env.events.request.add_listener(on_request)
        runner = env.create_local_runner()
        greenlets = [gevent.spawn(sample_rss, cluster.proc.pid, opts.sample_seconds, samples),
                     gevent.spawn(probe_health, cluster.target, http_target, probes)]
        marks["baseline"] = time.time()
        runner.start(opts.users, spawn_rate=opts.users)
        gevent.sleep(opts.baseline_minutes * 60)
        marks["attack"] = time.time()
        attack_s = max(10.0, (opts.minutes - opts.baseline_minutes - opts.after_minutes) * 60)
        with (opts.out / "attacks.log").open("w") as log:
            attacker = subprocess.Popen(
                [sys.executable, "-m", "bench.edge_attacks", "--grpc", cluster.target,
                 "--http", http_target, "--key", KEYS[0], "--probe-key", KEYS[1], "--seconds", str(attack_s),
                 "--hold", str(opts.hold), "--scale", str(opts.scale), "--out", str(opts.out / "attacks.jsonl")],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            while attacker.poll() is None:  # its last attack may run past attack_s: the phase waits
                gevent.sleep(1.0)
        marks["after"] = time.time()
        gevent.sleep(opts.after_minutes * 60)
        marks["end"] = time.time()
        runner.quit()
        gevent.killall(greenlets)
    finally:
        launcher_exit = cluster.stop()
    attacks = [json.loads(line) for line in (opts.out / "attacks.jsonl").read_text().splitlines()] \
        if (opts.out / "attacks.jsonl").exists() else []
    restart_lines = [line for line in (opts.out / "stack.log").read_text(errors="replace").splitlines()
                     if "restarting in" in line]
    return {"setup": {"minutes": opts.minutes, "fake_worker": opts.fake_worker, "users": opts.users,
                      "workers": opts.workers, "scale": opts.scale, "hold_s": opts.hold, "model": model,
                      "pagoda_flags": opts.pagoda_flags, "host": socket.gethostname(), "cpus": os.cpu_count(),
                      "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                               capture_output=True, text=True).stdout.strip()},
            "marks": marks, "attacker_exit": attacker.returncode, "launcher_exit": launcher_exit,
            "restart_lines": restart_lines, "legit": legit, "probes": probes, "rss": samples, "attacks": attacks}


# ---------------------------------------------------------------------------- the report

PHASES = ("baseline", "attack", "after")


def phase_of(t: float, marks: dict) -> str | None:
    for phase, end in zip(PHASES, (*PHASES[1:], "end")):
        if marks[phase] <= t < marks[end]:
            return phase
    return None


def pct(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q):.0f}" if values else "-"


def summarize(result: dict) -> dict:
    marks, out = result["marks"], {}
    groups = defaultdict(list)
    for r in result["legit"]:
        phase = phase_of(r["t"], marks)
        if phase:
            groups[(phase, r["tenant"])].append(r)
            groups[(phase, r["tenant"], r["protocol"])].append(r)
    out["legit"] = {" ".join(k): {
        "served": sum(r["cause"] is None for r in rs),
        "refused": dict(Counter(r["cause"] for r in rs if r["cause"])),
        "examples": {r["cause"]: r["detail"] for r in rs if r["cause"]},
        "p50_ms": pct([r["ms"] for r in rs if r["cause"] is None], 50),
        "p99_ms": pct([r["ms"] for r in rs if r["cause"] is None], 99),
        "ttft_p99_ms": pct([r["ttft_ms"] for r in rs if r["cause"] is None and r["ttft_ms"] is not None], 99)}
        for k, rs in sorted(groups.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0]))}
    health = defaultdict(list)
    for p in result["probes"]:
        for label in (phase_of(p["t"], marks), *(f"during {a['item']} {a['attack']}" for a in result["attacks"]
                                                  if a["start"] <= p["t"] <= a["end"])):
            if label:
                health[(label, p["kind"])].append(p)
    order = lambda k: (PHASES.index(k[0]), 0, k) if k[0] in PHASES else (9, int(k[0].split()[1]), k)  # noqa: E731
    out["health"] = {" ".join(k): {"probes": len(ps), "failed": sum(not p["ok"] for p in ps),
                                   "late_past_1s": sum(p["ok"] and p["s"] > 1.0 for p in ps),
                                   "max_s": round(max(p["s"] for p in ps), 2)}
                      for k, ps in sorted(health.items(), key=lambda kv: order(kv[0]))}
    attacks = defaultdict(lambda: {"runs": 0, "codes": Counter(), "probes": [], "notes": [], "details": set()})
    for a in result["attacks"]:
        s = attacks[(a["item"], a["attack"])]
        s["runs"] += 1
        s["codes"].update(a["codes"])
        s["probes"].append(a.get("probe"))
        s["details"].update(a.get("details", ()))
        s["notes"].append(a.get("note") or (f"{a['seconds']} s" if "seconds" in a else ""))
    out["attacks"] = {f"{item} {name}": {**s, "codes": dict(s["codes"]), "details": sorted(s["details"])[:8]}
                      for (item, name), s in sorted(attacks.items())}
    rss = {}
    for role in ROLES:
        series = [s["rss_mb"][role] for s in result["rss"]]
        pids = sorted({pid for s in result["rss"] for pid in s["pids"][role]})
        counts = [len(s["pids"][role]) for s in result["rss"]]
        by_phase = {f"{phase}_max_mb": round(max((s["rss_mb"][role] for s in result["rss"]
                                                  if phase_of(s["t"], marks) == phase), default=0))
                    for phase in PHASES}
        rss[role] = {**by_phase, "min_mb": round(min(series, default=0)), "max_mb": round(max(series, default=0)),
                     "first_mb": round(series[0]) if series else 0, "last_mb": round(series[-1]) if series else 0,
                     "pids_seen": len(pids), "alive_at_start": counts[0] if counts else 0,
                     "alive_at_end": counts[-1] if counts else 0}
    out["rss"] = rss
    # Restarted: a role that was given a new pid. Gateway children are the grammar compilers,
    # which the gateway itself replaces after a compile timeout: counted apart.
    out["restarts"] = {role: r["pids_seen"] - r["alive_at_start"] for role, r in rss.items() if role != "gateway child"}
    out["compiler_children_started"] = rss["gateway child"]["pids_seen"]
    return out


def markdown(result: dict, summary: dict) -> str:
    s, marks = result["setup"], result["marks"]
    minutes = lambda a, b: (marks[b] - marks[a]) / 60  # noqa: E731
    lines = [f"# Edge soak ({'fake worker' if s['fake_worker'] else s['model']}), {s['commit']}", "",
             f"{s['users']} locust users over {s['minutes']} min on {s['host']} ({s['cpus']} CPUs): "
             f"baseline {minutes('baseline', 'attack'):.1f} min, attacks {minutes('attack', 'after'):.1f} min, "
             f"after {minutes('after', 'end'):.1f} min; attack scale {s['scale']}, hold {s['hold_s']} s. "
             f"Launcher exit {result['launcher_exit']}, attacker exit {result['attacker_exit']}.", "",
             "## Legitimate requests", "", "| phase tenant [protocol] | served | refused by cause | p50 ms | p99 ms | "
             "stream first token p99 ms |", "|---|---|---|---|---|---|"]
    for k, v in summary["legit"].items():
        refused = ", ".join(f"{c} {n}" for c, n in sorted(v["refused"].items())) or "0"
        lines.append(f"| {k} | {v['served']} | {refused} | {v['p50_ms']} | {v['p99_ms']} | {v['ttft_p99_ms']} |")
    examples = {c: d for v in summary["legit"].values() for c, d in v["examples"].items()}
    lines += ["", "Each cause's message, once:", ""] + [f"- {c}: {d}" for c, d in sorted(examples.items())]
    lines += ["", "## Attacks (tenant A's key, or none)", "", "| item attack | runs | outcomes | a keyed bystander "
              "meanwhile (worst run) | notes |", "|---|---|---|---|---|"]
    for k, v in summary["attacks"].items():
        probes = [p for p in v["probes"] if p]
        worst = max(probes, key=lambda p: sum(not x.startswith("OK") for x in p.values()), default={})
        outcomes = ", ".join(f"{c}: {n}" for c, n in v["codes"].items())
        notes = "; ".join(sorted(set(filter(None, v["notes"]))))[:300]
        lines.append(f"| {k} | {v['runs']} | {outcomes} | {', '.join(f'{a} {b}' for a, b in worst.items())} | {notes} |")
    lines += ["", "What the server said to them:", ""] + [
        f"- {k}: {d}" for k, v in summary["attacks"].items() for d in v["details"]]
    lines += ["", "## Health probes (fresh connection each, every second)", "",
              "| when kind | probes | failed | late past 1 s | max s |", "|---|---|---|---|---|"]
    for k, v in summary["health"].items():
        lines.append(f"| {k} | {v['probes']} | {v['failed']} | {v['late_past_1s']} | {v['max_s']} |")
    lines += ["", "## RSS (MB, summed over a role's processes) and restarts", "",
              "| role | first | max in baseline | max in attacks | max after | last | pids seen | alive at start / end "
              "| restarts |", "|---|---|---|---|---|---|---|---|---|"]
    for role, v in summary["rss"].items():
        lines.append(f"| {role} | {v['first_mb']} | {v['baseline_max_mb']} | {v['attack_max_mb']} | {v['after_max_mb']} "
                     f"| {v['last_mb']} | {v['pids_seen']} | "
                     f"{v['alive_at_start']} / {v['alive_at_end']} | {summary['restarts'].get(role, '(compilers)')} |")
    lines += ["", f"The launcher logged {len(result['restart_lines'])} restart(s)"
              + (": " + "; ".join(result["restart_lines"][:5]) if result["restart_lines"] else "."), "",
              "RSS over time (MB):", "", "| s | " + " | ".join(ROLES) + " |", "|---" * (len(ROLES) + 1) + "|"]
    rows = result["rss"]
    for sample in rows[::max(1, len(rows) // 12)] + rows[-1:]:
        lines.append(f"| {sample['t'] - marks['baseline']:.0f} | "
                     + " | ".join(f"{sample['rss_mb'][r]:.0f}" for r in ROLES) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="the whole soak")
    ap.add_argument("--baseline-minutes", type=float, default=None, help="legitimate traffic only (default: a sixth)")
    ap.add_argument("--after-minutes", type=float, default=None, help="after the attacks (default: a tenth)")
    ap.add_argument("--fake-worker", action="store_true", help="tests' fake worker processes instead of the model")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--users", type=int, default=8, help="locust users, spread over the 4 kinds (2 tenants x gRPC/HTTP)")
    ap.add_argument("--max-tokens", type=int, default=16, help="of each legitimate request")
    ap.add_argument("--scale", type=float, default=1.0, help="the attacks' counts and sizes, times the issue's")
    ap.add_argument("--hold", type=float, default=10.0, help="seconds an attack holds what it opened")
    ap.add_argument("--sample-seconds", type=float, default=5.0, help="between RSS samples")
    ap.add_argument("--pagoda-flags", default="", help="more launcher flags, e.g. \"--dtype float32\"")
    ap.add_argument("--out", type=Path, required=True, help="folder for soak.json, soak.md and the logs")
    opts = ap.parse_args()
    opts.baseline_minutes = opts.minutes / 6 if opts.baseline_minutes is None else opts.baseline_minutes
    opts.after_minutes = opts.minutes / 10 if opts.after_minutes is None else opts.after_minutes
    result = run(opts)
    summary = summarize(result)
    (opts.out / "soak.json").write_text(json.dumps({**result, "summary": summary}, indent=1, default=str))
    report = markdown(result, summary)
    (opts.out / "soak.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()

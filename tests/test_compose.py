"""docker-compose.yml and the Dockerfile, checked as files (no docker runs here): every service
restarts when it dies, runs unprivileged, gets time to stop cleanly, and the servers carry
health checks that call this repository's own probe."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def pagoda_services() -> dict:
    """The services of pagoda's own image (the others are the monitoring profile's)."""
    return {k: v for k, v in services().items() if v.get("image") == "pagoda:latest"}


def seconds(text: str) -> float:
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text)):
        total += float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def flag(command: str, name: str) -> str | None:
    words = shlex.split(command)
    return words[words.index(name) + 1] if name in words else None


def test_every_service_restarts_runs_unprivileged_and_stops_with_sigterm():
    pagoda = pagoda_services()
    for name, svc in services().items():
        assert svc["restart"] in ("unless-stopped", "always"), name
        uid = str(svc["user"]).split(":")[0]
        # pagoda's image runs as its uid 10001; Prometheus and Grafana as their images' own
        # unprivileged users (nobody, grafana).
        assert int(uid) == (10001 if name in pagoda else {"prometheus": 65534, "grafana": 472}[name]), name
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM", name
        assert seconds(svc["stop_grace_period"]) >= 10, name


def test_the_gateway_gets_its_drain_period_before_compose_kills_it():
    gateway = services()["gateway"]
    grace = float(flag(gateway["command"], "--shutdown-grace-period"))
    assert grace >= 1 and seconds(gateway["stop_grace_period"]) >= grace + 5


def test_gateway_and_scheduler_have_health_checks_with_the_probe():
    svcs = services()
    gateway, scheduler = svcs["gateway"]["healthcheck"], svcs["scheduler"]["healthcheck"]
    port = flag(svcs["gateway"]["command"], "--port")
    assert gateway["test"] == ["CMD", "python", "-m", "launch.healthcheck", f"grpc://127.0.0.1:{port}"]
    metrics = flag(svcs["scheduler"]["command"], "--scheduler-metrics-port")
    assert scheduler["test"] == ["CMD", "python", "-m", "launch.healthcheck",
                                 f"http://127.0.0.1:{metrics}/metrics"]
    for check in (gateway, scheduler):
        assert seconds(check["interval"]) > 0 and seconds(check["timeout"]) > 0 and check["retries"] >= 1


def test_the_image_switches_to_the_unprivileged_user_after_its_last_build_step():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    users = [i for i, ln in enumerate(lines) if ln.startswith("USER ")]
    runs = [i for i, ln in enumerate(lines) if ln.startswith("RUN ")]
    assert users and users[-1] > runs[-1]
    assert lines[users[-1]].split()[1].split(":")[0] == str(services()["gateway"]["user"]).split(":")[0]
    assert "launch" in " ".join(ln for ln in lines if ln.startswith("COPY "))  # the probe ships


def test_commands_run_this_repository_with_flags_it_accepts_and_publish_its_ports():
    from tests.test_deploy import PARSERS, ports_opened

    svcs = pagoda_services()
    assert set(svcs) == {"scheduler", "worker", "gateway"}
    for name, svc in svcs.items():
        words = shlex.split(svc["command"])
        assert words[:2] == ["python", "-m"] and words[2] == f"{name}.main", name
        try:
            args = PARSERS[words[2]](words[3:])
        except SystemExit:
            raise AssertionError(f"{name}: {words[2]} refuses {words[3:]}") from None
        published = {int(p.split(":")[-1]) for p in svc.get("ports", [])}
        assert all(p.startswith("127.0.0.1:") for p in svc.get("ports", [])), name
        assert published <= ports_opened(words[2], args), name
        if name == "worker":  # scaled with --scale: a fixed host port would collide
            assert "ports" not in svc and args.scheduler_worker_address == "tcp://scheduler:5556"
        if name == "gateway":
            assert args.scheduler_gateway_address == "tcp://scheduler:5555"
            assert published == {args.port, args.http_port, args.gateway_metrics_port}


def test_the_image_builds_the_cpu_matmul_kernel_and_never_ships_a_host_build():
    """The worker's CPU matmul kernel is built in the image, with a compiler the image installs;
    a library built on the developer's host (another libc, maybe another CPU) stays out."""
    text = (ROOT / "Dockerfile").read_text()
    assert "python -m kernels.cpu_gemm --build" in text
    assert all(pkg in text.split("apt-get install", 1)[1].split("&&", 1)[0] for pkg in ("gcc", "libc6-dev"))
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "kernels/build" in ignored and ".venv" in ignored

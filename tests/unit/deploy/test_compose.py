"""docker-compose.yml and the Dockerfile, checked as files (no docker runs here; .ci/compose-check
and tests/integration/test_compose_real.py run them): every service restarts when it dies, runs unprivileged,
gets time to stop cleanly, and the servers carry health checks that call this repository's own
probe; the image holds every package; each role gets its own key volume."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from proto.keyset import ROLES

ROOT = Path(__file__).resolve().parents[3]


def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def image_services() -> dict:
    """Every service of pagoda's image: the servers, the keys one-shot, the GPU worker."""
    return {k: v for k, v in services().items() if str(v.get("image", "")).startswith("pagoda:")}


def pagoda_services() -> dict:
    """The three servers that `docker compose up` starts (not the keys one-shot, not a profile's)."""
    return {k: v for k, v in image_services().items() if k != "keys" and "profiles" not in v}


def expand(text: str, env: dict | None = None) -> str:
    """Compose's ${VAR:-default}, as a shell without VAR set (or with env's) reads it."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: (env or {}).get(m[1], m[2]), text)


def dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), one list per FROM
    (the first holds what comes before any FROM)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: list[list[str]] = [[]]
    for line in (ln.strip() for ln in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def seconds(text: str) -> float:
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text)):
        total += float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def flag(command: str, name: str) -> str | None:
    words = shlex.split(command)
    return words[words.index(name) + 1] if name in words else None


def test_every_service_restarts_runs_unprivileged_and_stops_with_sigterm():
    pagoda = image_services()
    for name, svc in services().items():
        # The keys service runs once, to its exit 0 (the servers wait for that).
        assert svc["restart"] in (("no",) if name == "keys" else ("unless-stopped", "always")), name
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
    from tests.unit.deploy.test_deploy import PARSERS, ports_opened

    svcs = pagoda_services()
    assert set(svcs) == {"scheduler", "worker", "gateway"}
    for name, svc in svcs.items():
        words = shlex.split(expand(svc["command"]))
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
            assert args.dtype == "auto"
            assert PARSERS[words[2]](shlex.split(expand(svc["command"], {"PAGODA_DTYPE": "float32"}))[3:]).dtype \
                == "float32"
        if name == "gateway":
            assert args.scheduler_gateway_address == "tcp://scheduler:5555"
            assert published == {args.port, args.http_port, args.gateway_metrics_port}


def test_every_package_in_pyproject_is_copied_into_the_image():
    """`pip install -e .` fails on a package directory that is not there (pagoda/ once was not)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # Each package's folder: its own name, or where package-dir puts it (pagoda.kernels: kernels/).
    folders = {setuptools.get("package-dir", {}).get(p, p.replace(".", "/")) for p in setuptools["packages"]}
    final = dockerfile_stages()[-1]
    copied = {ln.split()[1] for ln in final if ln.startswith("COPY ") and "--from" not in ln}
    top = {f.split("/")[0] for f in folders}  # a subpackage comes with its top package's folder
    assert top <= copied, sorted(top - copied)
    assert all((ROOT / f).is_dir() for f in folders)


def test_every_subpackage_is_installed():
    """setuptools installs the packages listed, not the folders below them: a subpackage left
    out of pyproject.toml works from the checkout and is missing from the installed wheel."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for p in packages if "." not in p for init in (ROOT / p).rglob("__init__.py")}
    assert found <= set(packages), sorted(found - set(packages))


def test_the_image_builds_the_cpu_matmul_kernel_readable_by_its_user_and_never_a_host_build():
    """The worker's CPU matmul kernel is built in the image, with a compiler the image installs,
    and made readable by all in the same step (built as root it is 0711, which uid 10001 cannot
    load); a library built on the developer's host (another libc, maybe another CPU) stays out."""
    final = dockerfile_stages()[-1]
    (build,) = [ln for ln in final if "python -m pagoda.kernels.cpu_gemm --build" in ln]
    assert build.split("python -m pagoda.kernels.cpu_gemm --build", 1)[1].strip() == "&& chmod -R a+rX /app"
    (apt,) = [ln for ln in final if "apt-get install" in ln]
    assert all(pkg in apt.split("apt-get install", 1)[1].split("&&", 1)[0] for pkg in ("gcc", "libc6-dev"))
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "kernels/build" in ignored and ".venv" in ignored and ".cache" in ignored


def test_the_base_image_is_a_build_argument_and_the_wheels_stay_in_the_first_stage():
    """An air-gapped site points BASE_IMAGE at its mirror. The wheels that .ci/compose-check hands
    the build, and any pip setting, live in the deps stage alone: the shipped stage takes only
    the venv from it."""
    before, deps, final = dockerfile_stages()
    assert before == ["ARG BASE_IMAGE=python:3.11-slim"]
    assert deps[0] == "FROM ${BASE_IMAGE} AS deps" and final[0] == "FROM ${BASE_IMAGE}"
    assert any(".cache/docker-wheel[s]" in ln for ln in deps) and "!.cache/docker-wheels" in (
        ROOT / ".dockerignore").read_text().split()
    assert [ln for ln in final if "--from" in ln] == ["COPY --from=deps /opt/venv /opt/venv"]
    assert not any(word in ln for ln in final for word in ("wheel", "PIP_", "pip.conf", "cert"))
    for name, svc in image_services().items():
        assert expand(svc["build"]["args"]["BASE_IMAGE"]) == "python:3.11-slim", name
        assert expand(svc["build"]["args"]["BASE_IMAGE"], {"PAGODA_BASE_IMAGE": "m/py"}) == "m/py"


def test_the_cpu_image_leaves_out_triton_and_the_cuda_variant_keeps_it():
    sys.path.insert(0, str(ROOT / "deploy" / "docker"))
    try:
        from requirements import no_deps_group, requirements
    finally:
        sys.path.remove(str(ROOT / "deploy" / "docker"))
    everything = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    cpu = requirements(str(ROOT / "pyproject.toml"), gpu=False)
    # xgrammar depends on Triton: on a CPU torch it goes in without its dependencies, after.
    xgrammar = [d for d in everything if d.startswith("xgrammar")]
    assert [d for d in everything if d not in cpu] == [
        d for d in everything if d.startswith("triton")] + xgrammar
    assert no_deps_group(str(ROOT / "pyproject.toml"), gpu=False)[0] == xgrammar[0]
    assert requirements(str(ROOT / "pyproject.toml"), gpu=True) == everything
    assert no_deps_group(str(ROOT / "pyproject.toml"), gpu=True) == []
    deps = dockerfile_stages()[1]
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in deps


def test_the_gpu_profile_runs_a_cuda_worker_on_a_reserved_gpu():
    from tests.unit.deploy.test_deploy import PARSERS

    gpu = services()["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["image"] == "pagoda:cuda"
    assert "/cu" in expand(gpu["build"]["args"]["TORCH_INDEX"])
    words = shlex.split(gpu["command"])
    args = PARSERS["worker.main"](words[3:])
    assert words[:3] == ["python", "-m", "worker.main"] and args.device == "cuda"
    assert args.scheduler_worker_address == "tcp://scheduler:5556"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "ports" not in gpu


def key_volume(svc: dict, env: dict | None = None) -> list[tuple[str, str, list[str]]]:
    """(source, target, options) of a service's key mounts."""
    mounts = [expand(v, env).split(":") for v in svc.get("volumes", [])]
    return [(m[0], m[1], m[2:]) for m in mounts if m[1].startswith("/keys")]


def test_each_role_mounts_its_own_key_volume_read_only_and_the_keys_service_fills_them():
    """One volume per role, as deploy/k8s mounts one Secret per pod: a server mounts its role's
    volume alone, read-only at its --zmq-keys-dir; the one-shot keys service mounts all three and
    every server waits for its exit 0."""
    svcs = services()
    keys = svcs["keys"]
    assert shlex.split(keys["command"]) == ["python", "deploy/docker/keys.py", "/keys"]
    assert sorted(key_volume(keys)) == sorted((f"keys-{r}", f"/keys/{r}", []) for r in ROLES)
    declared = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["volumes"]
    assert {f"keys-{r}" for r in ROLES} <= set(declared)
    for name, svc in image_services().items():
        if name == "keys":
            continue
        role = name.split("-")[0]
        assert key_volume(svc) == [(f"keys-{role}", flag(svc["command"], "--zmq-keys-dir"), ["ro"])], name
        assert svc["depends_on"]["keys"] == {"condition": "service_completed_successfully"}, name


def test_an_operator_mounts_their_own_keys_in_place_of_the_volumes():
    env = {f"PAGODA_{r.upper()}_KEYS": f"/srv/pagoda-keys/{r}" for r in ROLES}
    svcs = services()
    assert sorted(key_volume(svcs["keys"], env)) == sorted(
        (f"/srv/pagoda-keys/{r}", f"/keys/{r}", []) for r in ROLES)
    for name in ROLES:
        assert key_volume(svcs[name], env) == [(f"/srv/pagoda-keys/{name}", "/keys", ["ro"])]


def keys_module():
    """deploy/docker/keys.py, which the image runs as a script."""
    sys.path.insert(0, str(ROOT / "deploy" / "docker"))
    try:
        import keys
    finally:
        sys.path.remove(str(ROOT / "deploy" / "docker"))
    return keys


def split_keys(root: Path) -> str:
    return keys_module().split(root)


def test_the_keys_service_gives_each_role_what_it_loads_and_nothing_of_the_others(tmp_path):
    import argparse

    from proto.auth import check_auth_args

    assert "made" in split_keys(tmp_path)
    for role in ROLES:
        folder = tmp_path / role
        check_auth_args(argparse.Namespace(zmq_keys_dir=str(folder), insecure=False), role=role)
        secrets = sorted(p.name for p in folder.rglob("*_secret"))
        assert secrets == [f"{role}.key_secret"], role
        assert (folder / f"{role}.key_secret").stat().st_mode & 0o777 == 0o600
        assert folder.stat().st_mode & 0o777 == 0o700
    # The clients trust the scheduler the authorized/ folders let in: one set.
    scheduler_public = (tmp_path / "scheduler" / "scheduler.key").read_bytes()
    assert all((tmp_path / c / "scheduler.key").read_bytes() == scheduler_public
               for c in ("gateway", "worker"))


def test_the_keys_service_keeps_a_set_and_refuses_volumes_that_disagree(tmp_path):
    split_keys(tmp_path)
    before = (tmp_path / "worker" / "worker.key_secret").read_bytes()
    assert "kept" in split_keys(tmp_path)
    assert (tmp_path / "worker" / "worker.key_secret").read_bytes() == before
    shutil.rmtree(tmp_path / "worker")  # one volume removed alone
    with pytest.raises(SystemExit, match="disagree"):
        split_keys(tmp_path)
    assert not (tmp_path / "worker").exists()


def make_api_key(gateway: Path) -> str:
    return keys_module().api_key(gateway)


def test_the_keys_service_makes_an_api_key_once_and_prints_it_that_once(tmp_path):
    said = make_api_key(tmp_path / "gateway")
    path = tmp_path / "gateway" / "api-key"
    key = path.read_text().strip()
    assert len(key) == 43 and said.splitlines()[-1] == key  # 32 random bytes, URL-safe base64
    assert path.stat().st_mode & 0o777 == 0o600
    again = make_api_key(tmp_path / "gateway")
    assert "kept" in again and key not in again and path.read_text().strip() == key


def gateway_environment(env: dict, key_file: Path) -> subprocess.CompletedProcess:
    """The gateway's process started by its entrypoint, run by sh as Docker runs it (compose's $$
    read as $, the key file at key_file): it prints the PAGODA_API_KEY it got."""
    gateway = services()["gateway"]
    entry = [w.replace("$$", "$").replace("/keys/api-key", str(key_file)) for w in gateway["entrypoint"]]
    assert expand(gateway["environment"]["PAGODA_API_KEY"], env) == env.get("PAGODA_API_KEY", "")
    return subprocess.run([*entry, sys.executable, "-c", "import os; print(os.environ['PAGODA_API_KEY'])"],
                          env={"PATH": os.environ["PATH"], "PAGODA_API_KEY": env.get("PAGODA_API_KEY", "")},
                          capture_output=True, text=True, timeout=30)


def test_the_gateway_serves_with_the_made_api_key_unless_the_host_gives_one(tmp_path):
    from gateway.bounds.client_auth import ENV_API_KEY

    assert ENV_API_KEY == "PAGODA_API_KEY"
    make_api_key(tmp_path)
    made = (tmp_path / "api-key").read_text().strip()
    assert gateway_environment({}, tmp_path / "api-key").stdout.strip() == made
    assert gateway_environment({"PAGODA_API_KEY": "own-key"}, tmp_path / "api-key").stdout.strip() == "own-key"
    # No key at all: the gateway does not start, rather than serve without one.
    out = gateway_environment({}, tmp_path / "missing")
    assert out.returncode == 1 and out.stdout == "" and f"no API key in {tmp_path / 'missing'}" in out.stderr
    gateway = services()["gateway"]
    assert shlex.split(gateway["command"])[:3] == ["python", "-m", "gateway.main"]
    assert "--api-key" not in gateway["command"]


def test_each_role_has_its_own_cache_volume_and_the_schedulers_is_read_only():
    svcs = services()
    caches = {name: [v for v in svc["volumes"] if ":/cache" in v]
              for name, svc in image_services().items() if name != "keys"}
    assert caches == {"scheduler": ["cache-scheduler:/cache:ro"], "gateway": ["cache-gateway:/cache"],
                      "worker": ["cache-worker:/cache"], "worker-gpu": ["cache-worker:/cache"]}
    assert "volumes" not in svcs["keys"] or not any(":/cache" in v for v in svcs["keys"]["volumes"])
    declared = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["volumes"]
    assert {"cache-scheduler", "cache-gateway", "cache-worker"} <= set(declared)


def compose_clis() -> list[tuple[list[str], dict]]:
    """The Compose CLIs here: v2 (as a plugin, or the one .ci/compose-check fetched) and 1.29."""
    found = []
    cache = os.environ.get("PAGODA_CHECK_CACHE", "/var/cache/pagoda-compose-check")
    for env in ({}, {"DOCKER_CONFIG": f"{cache}/docker-config"}):
        if shutil.which("docker") and subprocess.run(
                ["docker", "compose", "version"], capture_output=True, env={**os.environ, **env}).returncode == 0:
            found.append((["docker", "compose"], env))
            break
    if shutil.which("docker-compose"):
        found.append((["docker-compose"], {}))
    return found


@pytest.mark.parametrize("cli,env", compose_clis() or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no Compose CLI here"))])
def test_every_compose_cli_here_accepts_the_file_with_its_profiles(cli, env):
    for profiles in ([], ["--profile", "monitoring"], ["--profile", "gpu"]):
        out = subprocess.run([*cli, "-f", str(ROOT / "docker-compose.yml"), *profiles, "config", "-q"],
                             capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
        assert out.returncode == 0, (cli, profiles, out.stderr)

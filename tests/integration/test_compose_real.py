"""docker-compose.yml run for real, as a user runs it: `docker compose up` on free 127.0.0.1
ports, then what that user sees. Driven by .ci/compose-check (`make compose-check`), which gets
Docker, the base image and the built image ready and sets PAGODA_COMPOSE_CHECK=1; elsewhere these
tests skip. The tests run in file order against one stack, and the last ones take it down."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from launch.healthcheck import healthy
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from proto.keyset import ROLES, KeySet
from tests.streams import Stream

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "pagoda:latest"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not os.environ.get("PAGODA_COMPOSE_CHECK"),
                       reason="needs Docker: run by `make compose-check` (.ci/compose-check)"),
]

LONG = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Tell me about rivers.")],
                          sampling=pb.SamplingParams(temperature=0),
                          stopping=pb.StoppingCriteria(max_tokens=64, ignore_eos=True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def docker(*args: str, timeout: float = 60) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=True,
                          timeout=timeout).stdout


class Stack:
    """One compose project on its own ports, driven by one compose CLI (v2 or 1.29)."""

    def __init__(self, cli: list[str]) -> None:
        self.project = f"pagoda-check-{os.getpid()}-{cli[-1].replace('-', '')}"
        self.ports = {name: free_port() for name in
                      ("GRPC", "HTTP", "GATEWAY_METRICS", "SCHEDULER_METRICS")}
        self.env = {**os.environ, **{f"PAGODA_{k}_PORT": str(v) for k, v in self.ports.items()},
                    # fp32 whatever the CPU: a killed worker's streams, recomputed on the other, are held
                    # to the undisturbed tokens, which fp32 keeps; bf16 rounds a recomputed prefill
                    # differently from the decode steps it replaces (docs/faults.md).
                    "PAGODA_DTYPE": "float32"}
        self.env.pop("PAGODA_API_KEY", None)  # the keys service's own, as a user gets it
        self.cli = [*cli, "-p", self.project, "-f", str(ROOT / "docker-compose.yml")]
        self.target = f"127.0.0.1:{self.ports['GRPC']}"
        self._key = ""

    def compose(self, *args: str, timeout: float = 180) -> str:
        out = subprocess.run([*self.cli, *args], cwd=ROOT, env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        assert out.returncode == 0, f"{shlex.join(args)}: {out.stdout}{out.stderr}"
        return out.stdout

    def containers(self, service: str) -> list[str]:
        return docker("ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                      "--filter", f"label=com.docker.compose.service={service}").split()

    def inspect(self, container: str, fmt: str) -> str:
        return docker("inspect", "-f", fmt, container).strip()

    def left_over(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: docker(*cmd, "--filter", label).split() for kind, cmd in
                {"containers": ("ps", "-a", "-q"), "networks": ("network", "ls", "-q"),
                 "volumes": ("volume", "ls", "-q")}.items()}

    def stub(self, ch: grpc.Channel) -> pagoda_pb2_grpc.GenerationStub:
        return pagoda_pb2_grpc.GenerationStub(ch)

    @property
    def key(self) -> str:
        """The API key the keys service made and printed once: the line after it says so."""
        if not self._key:
            lines = self.compose("logs", "--no-color", "keys").splitlines()
            (said,) = [i for i, ln in enumerate(lines) if "made the gateway's API key" in ln]
            self._key = lines[said + 1].split()[-1]
        return self._key

    @property
    def auth(self) -> tuple:
        return (("authorization", f"Bearer {self.key}"),)

    def workers(self) -> list[pb.WorkerLoad]:
        with grpc.insecure_channel(self.target) as ch:
            try:
                return list(self.stub(ch).GetLoads(pb.GetLoadsRequest(), metadata=self.auth,
                                                   timeout=5).workers)
            except grpc.RpcError:
                return []

    def scheduler_metrics(self) -> str:
        """The scheduler's full registry, on its loopback port: the operator's view."""
        url = f"http://127.0.0.1:{self.ports['SCHEDULER_METRICS']}/metrics"
        return urllib.request.urlopen(url, timeout=5).read().decode()

    def wait(self, what: str, ready, timeout: float = 180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := ready():
                return value
            time.sleep(0.5)
        logs = self.compose("logs", "--no-color", "--tail", "40")
        raise AssertionError(f"{self.project}: not {what} after {timeout}s\n{logs}")

    def serving(self, workers: int = 1, timeout: float = 180) -> None:
        self.wait(f"SERVING with {workers} worker(s)",
                  lambda: healthy(f"grpc://{self.target}")[0] and len(self.workers()) == workers,
                  timeout)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", timeout=240)


@pytest.fixture(scope="module")
def stack():
    s = Stack(["docker", "compose"])
    try:
        yield s
    finally:
        if any(s.left_over().values()):
            (ROOT / ".cache").mkdir(exist_ok=True)
            (ROOT / ".cache" / "compose-check.log").write_text(
                s.compose("logs", "--no-color", "--timestamps"))
            s.down()


def test_the_readme_command_serves_with_the_api_key_it_printed_once(stack):
    readme = (ROOT / "README.md").read_text()
    assert "`docker compose up`" in readme
    stack.compose("up", "-d")
    stack.serving(workers=1)
    (gateway,) = stack.containers("gateway")
    assert docker("exec", gateway, "cat", "/keys/api-key").strip() == stack.key
    assert len(stack.key) == 43
    with grpc.insecure_channel(stack.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            stack.stub(ch).Generate(LONG, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_readmes_grpcurl_call_answers(stack):
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines()
                if ln.startswith(".venv/bin/grpcurl") and '"messages"' in ln)
    words = [w.replace("127.0.0.1:50051", stack.target) for w in shlex.split(line)]
    words[0] = str(ROOT / words[0])
    words[1:1] = ["-H", f"authorization: Bearer {stack.key}"]  # docs/compose.md's form
    out = subprocess.run(words, capture_output=True, text=True, timeout=60, check=True).stdout
    messages, decoder, at = [], json.JSONDecoder(), 0
    while (at := out.find("{", at)) >= 0:
        message, at = decoder.raw_decode(out, at)
        messages.append(message)
    text = "".join(m.get("text", "") for m in messages)
    # transformers' greedy answer to this chat (SmolLM2-135M-Instruct, fp32): "The capital of
    # France is Paris." and EOS, 8 tokens; the suite holds the engine to transformers token by
    # token, this holds the container to the same answer, ending where it ends.
    assert text == "The capital of France is Paris.", text
    assert messages[-1]["finish_reason"] == "FINISH_REASON_STOP"
    assert messages[-1]["usage"]["completion_tokens"] == 8


def test_the_openai_sdk_answers(stack):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{stack.ports['HTTP']}/v1", api_key=stack.key)
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0,
                                         messages=[{"role": "user", "content": "Name three colors."}])
    assert out.choices[0].message.content.strip()
    assert out.usage.completion_tokens > 0


def test_public_metrics_are_the_cluster_gauges_alone_and_the_full_registry_stays_on_its_port(stack):
    page = urllib.request.urlopen(f"http://127.0.0.1:{stack.ports['HTTP']}/metrics", timeout=10).read().decode()
    names = {ln.split("{")[0] for ln in page.splitlines() if ln and not ln.startswith("#")}
    assert names == {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
    full = urllib.request.urlopen(f"http://127.0.0.1:{stack.ports['GATEWAY_METRICS']}/metrics",
                                  timeout=10).read().decode()
    assert "pagoda_gateway_requests_total" in full


def key_files(role: str) -> set[str]:
    """The files under /keys that a role's container holds (proto/keyset.py's needed_by): an
    authorized/ folder holds the key that the keys service put there."""
    root = Path("/keys")
    return {str(p.relative_to(root) / f"{p.name}.key") if p.parent.name == "authorized"
            else str(p.relative_to(root)) for p in KeySet(root).needed_by(role)}


def test_each_container_holds_only_its_roles_keys_readable_by_its_user(stack):
    for role in ROLES:
        (container,) = stack.containers(role)
        listing = docker("exec", container, "find", "/keys", "-type", "f", "-printf", r"%m %U %P\n")
        files = {path: (mode, uid) for mode, uid, path in (ln.split() for ln in listing.splitlines())}
        # The gateway holds the public side's API key beside its CURVE keys.
        assert set(files) == key_files(role) | ({"api-key"} if role == "gateway" else set()), role
        assert all(uid == "10001" for _, uid in files.values()), (role, files)
        assert all(mode == "600" for path, (mode, _) in files.items()
                   if path.endswith("_secret") or path == "api-key"), (role, files)


def test_the_worker_runs_the_cpu_matmul_kernel(stack):
    logs = stack.compose("logs", "--no-color", "worker")
    assert "run through kernels/cpu_gemm.c" in logs, logs[-3000:]
    assert "cpu_gemm kernel off" not in logs


def test_the_image_ships_no_pip_settings_ca_bundle_or_cuda_wheels():
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGE)
    for word in ("pip.conf", "PIP_", "--cert", "docker-wheels", "/tmp/wheels"):
        assert word not in history, word
    assert "PIP_" not in docker("image", "inspect", "-f", "{{json .Config.Env}}", IMAGE)
    probe = ("ls -d /etc/pip.conf /etc/xdg/pip /root/.config/pip /cache/.config/pip /tmp/wheels "
             "/usr/local/share/ca-certificates/*.crt 2>/dev/null; pip config list; "
             "pip list --format=freeze 2>/dev/null | grep -i -E '^(nvidia|triton)' ; "
             "cat /etc/ssl/certs/ca-certificates.crt")
    out = docker("run", "--rm", "--user", "0", "--entrypoint", "sh", IMAGE, "-c", probe)
    bundle_at = out.find("-----BEGIN CERTIFICATE-----")
    assert bundle_at >= 0 and not out[:bundle_at].strip(), out[:2000]
    # The host's own CAs (a proxy's, this workplace's) are not in the image's bundle.
    for ca in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        body = "".join(ca.read_text().split("-----")[2].split())
        assert body not in "".join(out.split()), ca


def test_scaled_to_two_workers_getloads_lists_both(stack):
    stack.compose("up", "-d", "--scale", "worker=2")
    stack.serving(workers=2)
    assert len({w.worker_id for w in stack.workers()}) == 2
    # Compose's own health checks agree (the gateway's probes every 10 s).
    for role in ("gateway", "scheduler"):
        (container,) = stack.containers(role)
        stack.wait(f"{role} healthy", lambda: stack.inspect(container, "{{.State.Health.Status}}")
                   == "healthy", timeout=60)


def busy_worker_container(stack: Stack) -> str | None:
    """A worker container with sequences running, from the scheduler's metrics (GetLoads names
    no worker's host): default worker ids are <hostname>-<pid>, a container's hostname its short id."""
    running = re.findall(r'^pagoda_num_requests_running\{worker="([^"]+)"\} (\S+)$',
                         stack.scheduler_metrics(), re.M)
    host = next((wid.rsplit("-", 1)[0] for wid, n in running if float(n) > 0), None)
    return next((c for c in stack.containers("worker") if host and c.startswith(host)), None)


def test_a_killed_workers_streams_finish_on_the_other(stack):
    with grpc.insecure_channel(stack.target) as ch:
        undisturbed = list(stack.stub(ch).Generate(LONG, metadata=stack.auth, timeout=120).token_ids)
        streams = [Stream(stack.stub(ch), LONG, timeout=180, metadata=stack.auth) for _ in range(4)]
        container = stack.wait("streaming on a worker", lambda: all(len(s.tokens) >= 4 for s in streams)
                               and busy_worker_container(stack), timeout=60)
        os.kill(int(stack.inspect(container, "{{.State.Pid}}")), signal.SIGKILL)
        for s in streams:
            s.join(180)
        assert [(s.code, s.details) for s in streams] == [(grpc.StatusCode.OK, "")] * 4
        assert all(s.tokens == undisturbed for s in streams)
    # The killed one is restarted by its restart policy and registers again.
    stack.serving(workers=2, timeout=120)


def test_a_killed_scheduler_comes_back_by_itself(stack):
    (container,) = stack.containers("scheduler")
    restarts = int(stack.inspect(container, "{{.RestartCount}}"))
    with grpc.insecure_channel(stack.target) as ch:
        stream = Stream(stack.stub(ch), LONG, timeout=120, metadata=stack.auth)
        stack.wait("streaming", lambda: len(stream.tokens) >= 2, timeout=60)
        os.kill(int(stack.inspect(container, "{{.State.Pid}}")), signal.SIGKILL)
        killed_at = time.monotonic()
        stream.join(60)
        # The requests in flight are lost with the scheduler, and the client is told so.
        assert stream.code == grpc.StatusCode.UNAVAILABLE, stream.details
        assert len(stream.tokens) < 64
    stack.wait("restarted", lambda: int(stack.inspect(container, "{{.RestartCount}}")) > restarts,
               timeout=60)
    stack.serving(workers=2, timeout=120)
    print(f"scheduler serving again {time.monotonic() - killed_at:.1f}s after its kill; the stream "
          f"in flight ended {stream.code.name} {stream.details!r}")
    with grpc.insecure_channel(stack.target) as ch:
        assert len(stack.stub(ch).Generate(LONG, metadata=stack.auth, timeout=120).token_ids) == 64


def test_compose_stop_lets_the_gateways_streams_finish(stack):
    with grpc.insecure_channel(stack.target) as ch:
        stream = Stream(stack.stub(ch), LONG, timeout=120, metadata=stack.auth)
        stack.wait("streaming", lambda: len(stream.tokens) >= 2, timeout=60)
        stack.compose("stop", "gateway", timeout=60)
        stream.join(60)
    assert (stream.code, len(stream.tokens)) == (grpc.StatusCode.OK, 64), stream.details


def test_down_v_leaves_no_containers_networks_or_volumes(stack):
    stack.down()
    assert stack.left_over() == {"containers": [], "networks": [], "volumes": []}
    docker("image", "inspect", IMAGE)  # the image stays, and so does the build cache


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="no docker-compose 1.29")
def test_debians_docker_compose_1_29_runs_the_same_file():
    s = Stack(["docker-compose"])
    version = subprocess.run(["docker-compose", "version", "--short"], capture_output=True,
                             text=True).stdout
    assert re.match(r"1\.29\.", version), version
    try:
        s.compose("up", "-d")
        s.serving(workers=1)
        with grpc.insecure_channel(s.target) as ch:
            assert len(s.stub(ch).Generate(LONG, metadata=s.auth, timeout=120).token_ids) == 64
    finally:
        s.down()
    assert s.left_over() == {"containers": [], "networks": [], "volumes": []}

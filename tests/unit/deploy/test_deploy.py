"""deploy/k8s, checked as files (no cluster runs here): each kustomization is rendered the way
kustomize would (resources, then strategic-merge patches), every object validates against the
Kubernetes 1.37 schema, and what the manifests say matches the code: each container runs a
module of this repository with flags its parser accepts, each port is one those flags open,
probes ask the health services the gateway serves, the Secret's items are the files proto/keyset.py
says each role loads, and the autoscaler reads metrics the scheduler exports."""
from __future__ import annotations

import argparse
import copy
import importlib.util
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
import zmq

from gateway.app import LIVENESS_SERVICE, SERVICE_NAME
from gateway.gateway_flags import parse_gateway_args
from proto.auth import CurveServer, check_auth_args, create_keys, secure_client
from scheduler.scheduler_flags import add_scheduler_args
from tests.metric_names import grouping_labels, names_in, scheduler_series
from worker.worker_flags import add_worker_args

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "overlays/gpu", "overlays/autoscaling"]
IMAGE_UID = 10001  # the Dockerfile's USER


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def merge(base, patch):
    """Kubernetes' strategic merge, as far as these manifests use it: maps merge, lists of named
    maps merge by name, any other list is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            at = next((i for i, x in enumerate(out) if x["name"] == item["name"]), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def render(folder: Path) -> list[dict]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "resources", "patches"}, f"{folder}: unhandled fields"
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = (folder / res).resolve()
        docs += render(path) if path.is_dir() else load_all(path)
    for p in k.get("patches", []):
        for patch in load_all(folder / p["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            at = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == key]
            assert len(at) == 1, f"{folder}: the patch {key} matches {len(at)} objects"
            docs[at[0]] = merge(docs[at[0]], patch)
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


PARSERS = {
    "scheduler.main": lambda argv: add_scheduler_args(argparse.ArgumentParser()).parse_args(argv),
    "worker.main": lambda argv: add_worker_args(argparse.ArgumentParser()).parse_args(argv),
    "gateway.main": parse_gateway_args,
}


def process_args(container: dict) -> tuple[str, argparse.Namespace]:
    """The module a container runs and its flags as that module's parser reads them."""
    command = container["command"]
    assert command[:2] == ["python", "-m"] and len(command) == 3, command
    module = command[2]
    assert importlib.util.find_spec(module) is not None, module
    try:
        return module, PARSERS[module](list(container.get("args", [])))
    except SystemExit:
        pytest.fail(f"{container['name']}: {module} refuses {container.get('args')}")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def ports_opened(module: str, a: argparse.Namespace) -> set[int]:
    if module == "scheduler.main":
        ports = {port_of(a.scheduler_gateway_address), port_of(a.scheduler_worker_address),
                 a.scheduler_metrics_port}
    elif module == "gateway.main":
        ports = {a.port, a.http_port, a.gateway_metrics_port}
    else:
        ports = set()  # a worker connects out and listens on nothing
    return ports - {0}


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request) -> list[dict]:
    return render(K8S / request.param)


def containers(docs: list[dict]):
    for name, dep in by_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield dep, c


def test_every_object_validates_against_the_kubernetes_schema(rendered):
    for doc in rendered:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
    assert set(by_kind(rendered, "Deployment")) == {"pagoda-scheduler", "pagoda-worker", "pagoda-gateway"}


def test_containers_run_this_repository_with_flags_it_accepts_and_declare_its_ports(rendered):
    for dep, c in containers(rendered):
        module, args = process_args(c)
        declared = {p["containerPort"] for p in c.get("ports", [])}
        assert declared == ports_opened(module, args), dep["metadata"]["name"]
        assert all("hostPort" not in p for p in c.get("ports", []))
        assert not dep["spec"]["template"]["spec"].get("hostNetwork")
        # Listening on the pod's address needs an explicit flag (loopback otherwise).
        if module == "scheduler.main":
            assert args.scheduler_worker_address.startswith("tcp://0.0.0.0:")
            assert args.scheduler_gateway_address.startswith("tcp://0.0.0.0:")
            assert args.scheduler_metrics_host == "0.0.0.0"
        if module == "gateway.main":
            assert (args.host, args.gateway_metrics_host) == ("0.0.0.0", "0.0.0.0")


def test_workers_and_gateways_reach_the_scheduler_through_its_service(rendered):
    deps, services = by_kind(rendered, "Deployment"), by_kind(rendered, "Service")
    sched_container = deps["pagoda-scheduler"]["spec"]["template"]["spec"]["containers"][0]
    _, sched = process_args(sched_container)
    named = {p["name"]: p["containerPort"] for p in sched_container["ports"]}
    for name, flag, bound in (("pagoda-worker", "scheduler_worker_address", sched.scheduler_worker_address),
                              ("pagoda-gateway", "scheduler_gateway_address", sched.scheduler_gateway_address)):
        _, args = process_args(deps[name]["spec"]["template"]["spec"]["containers"][0])
        host, port = getattr(args, flag)[len("tcp://"):].rsplit(":", 1)
        svc = services[host]
        assert svc["spec"]["selector"].items() <= deps["pagoda-scheduler"]["spec"]["template"]["metadata"]["labels"].items()
        target = next(p["targetPort"] for p in svc["spec"]["ports"] if p["port"] == int(port))
        assert named.get(target, target) == port_of(bound), name


def test_every_service_selects_pods_and_targets_ports_they_declare(rendered):
    deps = by_kind(rendered, "Deployment").values()
    for name, svc in by_kind(rendered, "Service").items():
        pods = [d for d in deps if svc["spec"]["selector"].items()
                <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, name
        ports = pods[0]["spec"]["template"]["spec"]["containers"][0]["ports"]
        names = {p["name"] for p in ports} | {p["containerPort"] for p in ports}
        assert all(p["targetPort"] in names for p in svc["spec"]["ports"]), name


def test_one_scheduler_several_gateways_and_scalable_workers(rendered):
    deps = by_kind(rendered, "Deployment")
    assert deps["pagoda-scheduler"]["spec"]["replicas"] == 1
    assert deps["pagoda-scheduler"]["spec"]["strategy"] == {"type": "Recreate"}
    assert deps["pagoda-gateway"]["spec"]["replicas"] >= 2
    assert "ports" not in deps["pagoda-worker"]["spec"]["template"]["spec"]["containers"][0]


def test_gateway_probes_ask_the_health_services_on_the_grpc_port(rendered):
    c = by_kind(rendered, "Deployment")["pagoda-gateway"]["spec"]["template"]["spec"]["containers"][0]
    _, args = process_args(c)
    assert c["readinessProbe"]["grpc"] == {"port": args.port, "service": SERVICE_NAME}
    assert c["livenessProbe"]["grpc"] == {"port": args.port, "service": LIVENESS_SERVICE}
    assert c["startupProbe"]["grpc"] == {"port": args.port, "service": LIVENESS_SERVICE}
    # Draining (--shutdown-grace-period) ends before the kubelet's SIGKILL.
    grace = by_kind(rendered, "Deployment")["pagoda-gateway"]["spec"]["template"]["spec"]
    assert grace["terminationGracePeriodSeconds"] >= args.shutdown_grace_period + 5


def test_gateways_serve_with_the_api_key_of_a_secret(rendered):
    """Secure by default where it ships: the gateway's key comes from the pagoda-api-key Secret
    (not optional: no Secret, no pod, rather than a gateway without authentication)."""
    from gateway.bounds.client_auth import ENV_API_KEY

    c = by_kind(rendered, "Deployment")["pagoda-gateway"]["spec"]["template"]["spec"]["containers"][0]
    (env,) = [e for e in c["env"] if e["name"] == ENV_API_KEY]
    assert env["valueFrom"] == {"secretKeyRef": {"name": "pagoda-api-key", "key": "api-key"}}
    assert "--api-key" not in " ".join(c["args"])  # never in the manifest itself


def test_scheduler_probes_its_own_metrics_endpoint(rendered):
    c = by_kind(rendered, "Deployment")["pagoda-scheduler"]["spec"]["template"]["spec"]["containers"][0]
    _, args = process_args(c)
    metrics = next(p["name"] for p in c["ports"] if p["containerPort"] == args.scheduler_metrics_port)
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": metrics}


def test_every_pod_is_unprivileged_read_only_and_requests_resources(rendered):
    for dep, c in containers(rendered):
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == IMAGE_UID
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        # The writable places: /tmp always, and the cache (PAGODA_CACHE=/cache in the image)
        # where a process converts the image's GGUF (the worker's weights, the gateway's tokenizer).
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        assert "emptyDir" in mounts["/tmp"]
        if dep["metadata"]["name"] != "pagoda-scheduler":
            assert "emptyDir" in mounts["/cache"]


def test_gpu_workers_only_in_the_gpu_overlay():
    for folder, gpus in (("base", None), ("overlays/gpu", "1")):
        worker = by_kind(render(K8S / folder), "Deployment")["pagoda-worker"]
        c = worker["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"].get("limits", {}).get("nvidia.com/gpu") == gpus
        assert process_args(c)[1].device == ("cuda" if gpus else "cpu")


ROLE_FILES = {"scheduler.main": "scheduler", "worker.main": "worker", "gateway.main": "gateway"}


def test_each_pod_gets_the_key_files_its_role_loads_and_they_authenticate(tmp_path):
    """Lays out each pod's Secret volume from a key set made by proto.auth, then connects a
    worker and a gateway to the scheduler's socket of their role with them: the handshake passes
    only with the right files in the right places."""
    keys = create_keys(tmp_path / "made")
    secret = {p.name: p.read_bytes() for p in keys.iterdir() if p.is_file()}  # kubectl --from-file=DIR
    dirs = {}
    for dep, c in containers(render(K8S / "base")):
        module, args = process_args(c)
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == args.zmq_keys_dir)
        assert mount["readOnly"] is True
        folder = tmp_path / ROLE_FILES[module]
        for item in volumes[mount["name"]]["secret"]["items"]:
            (folder / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            (folder / item["path"]).write_bytes(secret[item["key"]])
        check_auth_args(argparse.Namespace(zmq_keys_dir=str(folder), insecure=False),
                        role=ROLE_FILES[module])
        dirs[ROLE_FILES[module]] = folder
    # Only the scheduler holds a secret key other than its own role's.
    assert not any((dirs[r] / "scheduler.key_secret").exists() for r in ("worker", "gateway"))
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    server = CurveServer(ctx, dirs["scheduler"])
    try:
        for role in ("worker", "gateway"):
            router = ctx.socket(zmq.ROUTER)
            server.secure(router, role)
            port = router.bind_to_random_port("tcp://127.0.0.1")
            dealer = ctx.socket(zmq.DEALER)
            secure_client(dealer, dirs[role], role)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(role.encode())
            assert router.poll(5000), f"{role}: the CURVE handshake failed"
            assert router.recv_multipart()[-1] == role.encode()
    finally:
        server.stop()
        ctx.destroy(linger=0)


def test_the_autoscaler_scales_workers_on_metrics_the_adapter_derives_from_the_scheduler():
    docs = render(K8S / "overlays/autoscaling")
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["pagoda-worker"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "pagoda-worker"}
    values = yaml.safe_load((K8S / "overlays/autoscaling/prometheus-adapter-values.yaml").read_text())
    rules = {r["name"]["as"]: r for r in values["rules"]["external"]}
    wanted = {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert wanted and wanted <= set(rules)
    series = scheduler_series()
    for name in wanted:
        rule = rules[name]
        used = names_in(rule["seriesQuery"]) | names_in(rule["metricsQuery"])
        assert used and used <= set(series), name
        assert grouping_labels(rule["metricsQuery"]) == {"namespace"}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]

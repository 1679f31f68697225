"""The monitoring kit, checked as files: the Grafana dashboard reads only series the scheduler and
the gateway really export (tests/metric_names.py reads them from the code), with labels they
carry, and covers what an operator watches; the compose `monitoring` profile starts Prometheus
scraping the ports the services' flags open, and Grafana with that dashboard and its data source
provisioned."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from tests.metric_names import all_series, grouping_labels, names_in
from tests.unit.deploy.test_compose import flag, services

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "pagoda.json"
# Labels Prometheus adds to every scraped series, beside the metric's own.
TARGET_LABELS = {"instance", "job", "namespace", "pod"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p["targets"]]


def test_every_dashboard_query_reads_series_that_exist_by_labels_they_carry():
    series = all_series()
    assert exprs()
    for title, expr in exprs():
        used = names_in(expr)
        assert used, f"{title}: {expr} reads no pagoda series"
        missing = used - set(series)
        assert not missing, f"{title}: {sorted(missing)} are not exported"
        labels = set().union(*(series[n] for n in used)) | TARGET_LABELS
        assert grouping_labels(expr) <= labels, f"{title}: groups by a label {used} lack"
        if "histogram_quantile" in expr:
            assert all(n.endswith("_bucket") for n in used) and "le" in grouping_labels(expr), title
    variable = dashboard()["templating"]["list"][0]
    assert names_in(variable["definition"]) <= set(series)


def test_the_dashboard_covers_what_the_issue_names():
    used = set().union(*(names_in(e) for _, e in exprs()))
    wanted = {
        "request rate": "pagoda_gateway_requests_total",
        "TTFT": "pagoda_gateway_time_to_first_token_seconds_bucket",
        "TPOT": "pagoda_gateway_time_per_output_token_seconds_bucket",
        "KV usage": "pagoda_kv_cache_usage_ratio",
        "prefix-cache hit rate": "pagoda_prefix_cache_hits_total",
        "preemptions": "pagoda_num_preemptions_total",
        "queue length": "pagoda_num_requests_waiting",
    }
    assert {k for k, v in wanted.items() if v not in used} == set()
    per_worker = [e for _, e in exprs() if "pagoda_kv" in e or "pagoda_num_" in e]
    assert all('worker=~"$worker"' in e for e in per_worker)
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_the_monitoring_profile_scrapes_the_ports_the_services_open():
    svcs = services()
    monitoring = {k for k, v in svcs.items() if "monitoring" in v.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    assert all("profiles" not in svcs[k] for k in ("scheduler", "worker", "gateway"))
    prom = svcs["prometheus"]
    config_file = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    host_path = mounted(prom, config_file)
    config = yaml.safe_load(host_path.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = {f"scheduler:{flag(svcs['scheduler']['command'], '--scheduler-metrics-port')}",
                f"gateway:{flag(svcs['gateway']['command'], '--gateway-metrics-port')}"}
    assert targets == expected
    assert flag(svcs["scheduler"]["command"], "--scheduler-metrics-host") == "0.0.0.0"
    assert flag(svcs["gateway"]["command"], "--gateway-metrics-host") == "0.0.0.0"


def test_grafana_is_provisioned_with_the_dashboard_and_the_prometheus_datasource():
    svcs = services()
    grafana = svcs["grafana"]
    provisioning = mounted(grafana, "/etc/grafana/provisioning")
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    port = svcs["prometheus"]["ports"][0].split(":")[-1]
    assert [(s["type"], s["uid"], s["url"]) for s in sources] == [
        ("prometheus", "prometheus", f"http://prometheus:{port}")]
    uids = {t["datasource"]["uid"] for p in dashboard()["panels"] for t in p["targets"]}
    assert uids == {"prometheus"}
    providers = yaml.safe_load((provisioning / "dashboards" / "pagoda.yml").read_text())["providers"]
    folder = providers[0]["options"]["path"]
    assert mounted(grafana, f"{folder}/pagoda.json") == DASHBOARD
    assert all(p.startswith("127.0.0.1:") for s in ("prometheus", "grafana") for p in svcs[s]["ports"])


def mounted(service: dict, container_path: str) -> Path:
    """The repository file or folder a service mounts at container_path (read-only)."""
    for volume in service["volumes"]:
        source, target, *mode = volume.split(":")
        if target == container_path:
            assert mode == ["ro"], volume
            path = (ROOT / source).resolve()
            assert path.exists(), volume
            return path
    raise AssertionError(f"nothing is mounted at {container_path}: {shlex.join(service['volumes'])}")

"""The Prometheus series the scheduler and the gateway really expose, with their labels: what a
dashboard, an alert or an autoscaler rule may name. Read from the code's own collectors (the
scheduler's over a router with one registered worker), never from a list kept by hand."""
from __future__ import annotations

import re

from prometheus_client.metrics import MetricWrapperBase

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def _series(name: str, kind: str, labels: set[str]) -> dict[str, set[str]]:
    base = name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name
    out = {base + s: set(labels) for s in _SUFFIXES[kind]}
    if kind == "histogram":
        out[base + "_bucket"].add("le")
    return out


def scheduler_series() -> dict[str, set[str]]:
    from proto import internal_pb2 as pb
    from scheduler.metrics import RouterCollector
    from scheduler.router import Router, RouterConfig
    from tests.fake_worker import FakeWorker

    router = Router(RouterConfig())
    router.register(b"w0", FakeWorker(64, num_speculative_tokens=2).hello())  # spec_decode_*
    router.add(b"gw", pb.AddRequest(request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=4,
                                    sampling=pb.SamplingConfig()))
    out: dict[str, set[str]] = {}
    for family in RouterCollector(router).collect():
        labels = {k for s in family.samples for k in s.labels}
        assert family.samples, f"{family.name} has no sample with a worker registered"
        out.update(_series(family.name, family.type, labels))
    return out


def gateway_series() -> dict[str, set[str]]:
    from gateway import metrics

    out: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            # _labelnames: a labelled metric has no samples (hence no labels to read) until
            # its first observation.
            out.update(_series(value._name, value._type, set(value._labelnames)))
    return out


def all_series() -> dict[str, set[str]]:
    return {**scheduler_series(), **gateway_series()}


_NAME = re.compile(r"\bpagoda_[a-z0-9_]+\b")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def names_in(expr: str) -> set[str]:
    """The pagoda_* series a PromQL expression reads."""
    return set(_NAME.findall(expr))


def grouping_labels(expr: str) -> set[str]:
    """The labels of every by (...) / without (...) in a PromQL expression."""
    return {label.strip() for group in _BY.findall(expr) for label in group.split(",") if label.strip()}

"""The HTTP API fuzzed from its own OpenAPI document (gateway/rest/openapi.py) with schemathesis, for
tests/faults/test_fuzz_api.py (the fake worker, few examples) and bench/fuzz_api.py (the real
model, many): an operation's requests drawn by hypothesis from the document, half of them
valid by it and half not, each sent to a running gateway with the key, and its answer checked:
no 5xx, a status code, media type and body the document lists, and a request the document calls
invalid refused with a 4xx. Failures are collected rather than raised, so that one run reports
every kind it meets; the seed makes a run repeat exactly."""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance,
                                               status_code_conformance)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


def load(base_url: str):
    """The gateway's document, as schemathesis reads it, checked against OpenAPI's own schema."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    schema.validate()
    return schema


@dataclass
class Report:
    operation: str
    examples: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # a title line, then what was sent
    refusals: Counter = field(default_factory=Counter)  # the `param` of each 4xx
    messages: dict = field(default_factory=dict)  # param -> the first message naming it
    seconds: float = 0.0

    def kinds(self) -> Counter:
        return Counter(f.split("\n", 1)[0] for f in self.failures)


def _aimed(case, model: str) -> None:
    """Most generated bodies name a model the gateway does not serve (404 before any other
    field is read): the served one instead, where the body names one at all."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = model


def fuzz(schema, path: str, method: str, base_url: str, key: str, model: str, examples: int,
         seed: int, timeout: float = 30.0, max_failures: int = 1000) -> Report:
    """timeout: each request's; past max_failures the rest of the examples are not sent."""
    operation = schema[path][method.upper()]
    report = Report(f"{method.upper()} {path}")
    strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                         operation.as_strategy(GenerationMode.NEGATIVE))
    headers = {"Authorization": f"Bearer {key}"}
    session = requests.Session()

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                         phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=list(HealthCheck), derandomize=False)
    @hypothesis.given(case=strategy)
    def run(case) -> None:
        if len(report.failures) >= max_failures:
            return
        _aimed(case, model)
        report.examples += 1
        try:
            response = case.call(base_url=base_url, headers=headers, session=session,
                                 timeout=timeout)
        except requests.RequestException as e:  # a reset or a hang: as bad as a 500
            report.failures.append(f"no answer: {type(e).__name__}\n{_body(case)}")
            return
        report.statuses[response.status_code] += 1
        if 400 <= response.status_code < 500:
            param, message = _error(response)
            report.refusals[param] += 1
            report.messages.setdefault(param, message)
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except FailureGroup as group:
            for failure in group.exceptions:
                report.failures.append(f"{failure.title}: {response.status_code}\n"
                                       f"{failure.message}\n{_body(case)}\n"
                                       f"{response.text[:500]}")

    started = time.monotonic()
    try:
        run()
    finally:
        session.close()
        report.seconds = time.monotonic() - started
    return report


def _error(response) -> tuple[str, str]:
    try:
        error = response.json()["error"]
        return str(error["param"]), str(error["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return "?", response.text[:300]


def _body(case) -> str:
    try:
        text = json.dumps(case.body, ensure_ascii=False) if case.body is not None else ""
    except (TypeError, ValueError):
        text = repr(case.body)
    return f"{case.method} {case.formatted_path} {text[:1000]}"

"""The gRPC API (proto/pagoda.proto's Generation service) fuzzed with hypothesis-drawn messages
(tests/proto_strategies.py), for tests/faults/test_fuzz_api.py (the fake worker, few examples)
and bench/fuzz_api.py (the real model, many). Each RPC gets requests of every field's edges,
half of them steered past the first checks (tame: a prompt of token ids the worker knows,
few fields set, small values), sent with
the key, without it or with a wrong one, and must end with a status the API documents: never
INTERNAL or UNKNOWN (a handler that raised), never a hang past the deadline. Failures are
collected, not raised, so that one run reports every kind it meets."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

import grpc
import hypothesis
from google.protobuf import message_factory
from hypothesis import HealthCheck, Phase, strategies as st

from proto import pagoda_pb2
from tests.proto_strategies import Sizes, messages

SERVICE = pagoda_pb2.DESCRIPTOR.services_by_name["Generation"]
RPCS = [m.name for m in SERVICE.methods]
# A handler that raised (INTERNAL: caught by the servicer; UNKNOWN: by grpc.aio itself), a
# message the server could not read or write, or a call that did not end in time.
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
       grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass
class Report:
    rpc: str
    examples: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # status -> the first details with it
    refusals: Counter = field(default_factory=Counter)  # the field each refusal names first
    seconds: float = 0.0

    def kinds(self) -> Counter:
        return Counter(f.split("\n", 1)[0] for f in self.failures)


def describe(msg, width: int = 60) -> str:
    """A request in a few lines: long strings and lists shortened, with their lengths."""
    parts = []
    for field, value in msg.ListFields():
        if field.is_repeated and len(value) > 3:
            first = (_short(dict([next(iter(value.items()))]), width) if hasattr(value, "items")
                     else _short(value[0], width))
            parts.append(f"{field.name}: {len(value)} entries, first {first}")
        elif hasattr(value, "ListFields"):
            parts.append(f"{field.name} {{{describe(value, width)}}}")
        else:
            parts.append(f"{field.name}: {_short(value, width)}")
    return ", ".join(parts)


def _short(value, width: int) -> str:
    if hasattr(value, "ListFields"):
        return f"{{{describe(value, width)}}}"
    if hasattr(value, "items"):  # a map
        return "{" + ", ".join(f"{k}: {_short(v, width)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and len(value) > width:
        return f"{value[:width]!r}... ({len(value)} characters)"
    if not isinstance(value, str) and hasattr(value, "__len__") and len(value) <= 3:
        return "[" + ", ".join(_short(v, width) for v in value) + "]"
    return repr(value)[:width * 2]


def steered(vocab_size: int, max_tokens: int) -> dict:
    """Overrides that carry some requests past the first checks into the scheduler."""
    P = "pagoda.v1."
    return {f"{P}GenerateRequest.prompt_token_ids": st.lists(st.integers(0, vocab_size - 1),
                                                             min_size=1, max_size=8),
            f"{P}GenerateRequest.prompt": None, f"{P}GenerateRequest.messages": None,
            f"{P}StoppingCriteria.max_tokens": st.integers(-2, max_tokens),
            f"{P}DetokenizeRequest.token_ids": st.lists(st.integers(0, vocab_size + 1), max_size=16)}


def fuzz(channel: grpc.Channel, rpc: str, key: str, examples: int, seed: int,
         sizes: Sizes = Sizes(), vocab_size: int = 49152, max_tokens: int = 16,
         timeout: float = 30.0, max_failures: int = 1000) -> Report:
    """timeout: each call's deadline; past max_failures the rest of the examples are not sent."""
    method = SERVICE.methods_by_name[rpc]
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    path = f"/{SERVICE.full_name}/{rpc}"
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    call = kind(path, request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString)
    strategy = st.one_of(messages(request_cls, sizes),
                         messages(request_cls, replace(sizes, tame=True),
                                  steered(vocab_size, max_tokens)))
    keys = st.sampled_from([key] * 8 + [None, "not-" + key])
    report = Report(rpc)

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                         phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=list(HealthCheck))
    @hypothesis.given(request=strategy, sent_key=keys)
    def run(request, sent_key) -> None:
        if len(report.failures) >= max_failures:
            return
        report.examples += 1
        metadata = (("authorization", f"Bearer {sent_key}"),) if sent_key else ()
        try:
            answer = call(request, metadata=metadata, timeout=timeout)
            if method.server_streaming:
                for _ in answer:
                    pass
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        report.statuses[code.name] += 1
        report.details.setdefault(code.name, details[:300])
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            report.refusals[details.split(" ", 1)[0].rstrip(":")] += 1
        # the details were too large for the client's metadata limit: it never saw them
        if code in BAD or "metadata size exceeds" in details:
            report.failures.append(f"{code.name}: {details[:300]}\n{rpc} "
                                   f"({request.ByteSize()} bytes) {describe(request)}")

    started = time.monotonic()
    try:
        run()
    finally:
        report.seconds = time.monotonic() - started
    return report

"""sampling.structured_output, checked at the edge: its kind, its size (--max-structured-output-
bytes, before anything is compiled), that beam search is not asked with it, that a JSON schema
is JSON. Whether it compiles is asked of gateway/grammar/grammar_check.py afterwards, off the loop."""
from __future__ import annotations

from gateway import json_nesting
from proto import pagoda_pb2
from structured.spec import Spec

FIELD = "sampling.structured_output"
MAX_CHOICES = 1024


class StructuredError(ValueError):
    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def structured_spec(req: pagoda_pb2.GenerateRequest, max_bytes: int) -> Spec | None:
    s = req.sampling
    if not s.HasField("structured_output"):
        return None
    spec = Spec.from_proto(s.structured_output)
    if spec is None:
        raise StructuredError(FIELD, f"{FIELD} names no kind: set one of json_schema, "
                                     "json_object, regex, choice, grammar and structural_tag")
    name = f"{FIELD}.{spec.kind}"
    if req.HasField("beam_search") and req.beam_search.beam_width > 0:
        raise StructuredError("use_beam_search", "use_beam_search: beam search cannot be "
                                                 f"combined with {FIELD}")
    if spec.size > max_bytes:
        raise StructuredError(name, f"{name} is {spec.size} bytes, at most {max_bytes} are "
                                    "allowed (--max-structured-output-bytes)")
    if spec.kind == "choice":
        if not spec.choices:
            raise StructuredError(name, f"{name} has no values")
        if len(spec.choices) > MAX_CHOICES:
            raise StructuredError(name, f"{name} has {len(spec.choices)} values, at most "
                                        f"{MAX_CHOICES} are allowed")
    if spec.kind in ("json_schema", "structural_tag"):
        try:
            value = json_nesting.loads(spec.value)  # TooDeep past MAX_JSON_DEPTH levels
        except ValueError as e:
            raise StructuredError(name, f"{name} is not JSON: {e}") from None
        if spec.kind == "json_schema" and not isinstance(value, (dict, bool)):
            raise StructuredError(name, f"{name} must be a JSON object (a schema), got "
                                        f"{type(value).__name__}")
    if spec.kind in ("regex", "grammar") and not spec.value:
        raise StructuredError(name, f"{name} is empty")
    return spec

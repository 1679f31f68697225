"""The one error a request check raises, in a module of its own: gateway/validation/validate.py and the
checks it calls (gateway/validation/beam_request.py) both raise it without importing each other."""
from __future__ import annotations


# Trailing metadata of a refused call: the request field at fault (HTTP's `param`).
FIELD_METADATA = "pagoda-field"


class ValidationError(ValueError):
    """Becomes INVALID_ARGUMENT; str() is the client-facing message and starts with the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name

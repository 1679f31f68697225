"""Structured outputs in the worker: each row's grammar matcher and its hook in the step."""

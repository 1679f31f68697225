"""The OpenAI-compatible HTTP API: routes, the OpenAI request and answer shapes (with vLLM's
extras), its errors, server-sent events, tools and structured outputs in OpenAI's words, the
OpenAPI document, and uvicorn inside the gateway's loop.

Nothing is imported here.
"""

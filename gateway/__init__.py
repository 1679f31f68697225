"""pagoda's gateway: gRPC (pagoda.v1.Generation, health, reflection) and the OpenAI-compatible
HTTP API in, ZeroMQ to the scheduler. It owns text (tokenizing, chat templates, detokenizing).

Subpackages, by idea: validation/ (a request -> the finished AddRequest), generation/ (the
Generation service, the core every route shares), rest/ (HTTP in OpenAI's shapes), chat/ (chat
templates and tools), grammar/ (the structured-output check's compiler children), bounds/ (the
edge's limits on connections, calls and bytes), scheduler_link/ (the ZeroMQ link). Here: the
process (main.py, app.py), its flags (gateway_flags.py), the tokenizer, the one status mapping
(statuses.py), metrics and JSON nesting bounds. Nothing is imported here, so
`gateway.gateway_flags` stays cheap to import.
"""

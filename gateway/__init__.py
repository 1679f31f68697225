"""pagoda's gateway: gRPC (pagoda.v1.Generation, health, reflection) in, ZeroMQ to the scheduler.

It owns text: tokenizer.py (tokenizer + chat template), validate.py (requests -> AddRequest),
detokenize.py (incremental text + stop strings), scheduler_client.py (the ZeroMQ link),
server.py (the RPCs), app.py (one gateway assembled), main.py (the process), metrics.py,
testing.py (a fake scheduler). Nothing is imported here, so `gateway.gateway_flags` stays cheap
to import.
"""

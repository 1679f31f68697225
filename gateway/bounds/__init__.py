"""The public edge's bounds on connections, calls and bytes: the flags' EdgeConfig, API keys and
tenants, gRPC's call slots and message sizes, the HTTP port's pools.

Nothing is imported here.
"""

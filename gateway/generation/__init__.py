"""The pagoda.v1.Generation service: the servicer (server.py, the core the HTTP API shares), the
answer assembled from what the scheduler sends, and the bounds on the work and memory one answer
may take (large inputs off the loop, whole answers).

Nothing is imported here.
"""

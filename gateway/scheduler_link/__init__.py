"""The gateway's one ZeroMQ connection to the scheduler, the range checks on what it receives,
and each request's bounded inbox.

Nothing is imported here.
"""

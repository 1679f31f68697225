"""A GenerateStream read to its end in a thread, for tests that watch streams while something
else happens to the stack."""
from __future__ import annotations

import threading
import time

import grpc

from proto import pagoda_pb2 as pb


class Stream(threading.Thread):
    """One GenerateStream read to its end in a thread: its tokens, and how and when it ended."""

    def __init__(self, stub, req: pb.GenerateRequest, timeout: float = 60,
                 metadata: tuple = ()) -> None:
        super().__init__(daemon=True)
        self.stub, self.req, self.timeout, self.metadata = stub, req, timeout, metadata
        self.tokens: list[int] = []
        self.token_times: list[float] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            for r in self.stub.GenerateStream(self.req, timeout=self.timeout,
                                              metadata=self.metadata or None):
                self.tokens += r.token_ids
                self.token_times += [time.monotonic()] * len(r.token_ids)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details()
        self.ended_at = time.monotonic()

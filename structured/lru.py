"""A least-recently-used map bounded in bytes as well as in entries: the grammar caches (the
gateway's answers, every compiler's compiled grammars) hold what clients chose, and one compiled
grammar can take megabytes (xgrammar's memory_size_bytes), so a count alone bounds nothing.
Thread-safe: a worker compiles on a thread of its own while its loop reads hits."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class BytesLru(Generic[V]):
    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: str, value: V, size: int) -> None:
        """Keeps value (size bytes, the key's included by the caller), evicting the least recently
        used entries past either bound; a value larger than the whole bound is not kept."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)

"""Sequences in flight per tenant (AddRequest.tenant: the gateway's name for an API key, "" for
none), so that one tenant cannot fill the waiting queue that every tenant shares."""
from __future__ import annotations

from collections import Counter


class TenantLoad:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # sequences in flight per tenant; 0 = none beyond the queue's bound
        self.in_flight: Counter[str] = Counter()

    def refusal(self, tenant: str, n: int) -> str | None:
        """Why n more sequences of this tenant cannot be admitted now, or None."""
        held = self.in_flight[tenant]
        if self.limit and held + n > self.limit:
            return (f"this tenant has {held} sequences in flight and may have at most "
                    f"{self.limit} (--max-seqs-per-tenant); retry later")
        return None

    def admit(self, tenant: str, n: int) -> None:
        self.in_flight[tenant] += n

    def release(self, tenant: str, n: int) -> None:
        left = self.in_flight[tenant] - n
        if left > 0:
            self.in_flight[tenant] = left
        else:
            del self.in_flight[tenant]  # a tenant with nothing in flight costs nothing

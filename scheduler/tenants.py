"""Tenants (AddRequest.tenant: the gateway's name for an API key, "" for none): the sequences each
has in flight, against --max-seqs-per-tenant, and the order their requests wait in.

The order is start-time fair queuing (Goyal et al., 1996) over sequences: a request's place in
line (Request.arrival, after its priority) is its tenant's virtual start time, the later of the
line's head now and where the tenant's previous request ended, advanced by the sequences it
runs (n, or a beam search's width). One tenant alone, or every client without keys (one tenant,
""), gets first come, first served; a tenant that floods queues behind itself, so another's
request waits behind at most the requests already at the head. Nothing is held back: the order
only decides who goes next while others wait, so a lone tenant has the whole cluster, and an idle
tenant banks no credit (its next request starts at the head, not behind it).
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator

from scheduler.request import Request, Status


class TenantLoad:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # sequences in flight per tenant; 0 = none beyond the queue's bound
        self.in_flight: Counter[str] = Counter()
        self.finish: dict[str, int] = {}  # each tenant's virtual finish time
        # Each tenant's requests in the order of their tags, those that may still wait; the ones
        # that run or ended leave lazily from the front (head()) and the back (newest_waiting()).
        self.lines: dict[str, deque[Request]] = {}
        self.clock = 0  # the latest start tag given: the head when nothing waits
        self.held: dict[str, int] = {}  # sequences each request in flight counts, by its id

    def refusal(self, tenant: str, n: int) -> str | None:
        """Why n more sequences of this tenant cannot be admitted now, or None."""
        held = self.in_flight[tenant]
        if self.limit and held + n > self.limit:
            return (f"this tenant has {held} sequences in flight and may have at most "
                    f"{self.limit} (--max-seqs-per-tenant); retry later")
        return None

    def tag(self, tenant: str, cost: int) -> int:
        """The place in line of a request of `cost` sequences arriving now."""
        start = max(self.head(), self.finish.get(tenant, 0))
        self.finish[tenant] = start + cost
        self.clock = max(self.clock, start)
        return start

    def head(self) -> int:
        """The smallest tag of a request still waiting, else the latest tag given."""
        head = self.clock
        for tenant, line in list(self.lines.items()):
            while line and not _waits(line[0]):
                line.popleft()
            if line:
                head = min(head, line[0].arrival)
            else:
                del self.lines[tenant]
        return head

    def admit(self, handle: Request, n: int) -> None:
        """A request of n sequences (handle: its first, or its beam search's) was admitted."""
        self.in_flight[handle.tenant] += n
        self.held[handle.request_id] = n
        line = self.lines.setdefault(handle.tenant, deque())
        line.append(handle)
        if len(line) > 2 * self.in_flight[handle.tenant] + 8:
            # Ended ones stuck behind a front that still waits: dropped now, so that the line
            # holds no more than twice what the tenant has in flight (amortized once per entry).
            self.lines[handle.tenant] = deque(r for r in line if _waits(r))

    def end(self, handle: Request) -> None:
        """The request admitted with handle ended: what it counted is released."""
        self.release(handle.tenant, self.held.pop(handle.request_id, 0))

    def release(self, tenant: str, n: int) -> None:
        left = self.in_flight[tenant] - n
        if left > 0:
            self.in_flight[tenant] = left
        else:
            # A tenant with nothing in flight costs nothing, and starts at the head again.
            del self.in_flight[tenant]
            self.finish.pop(tenant, None)

    def newest_waiting(self, tenant: str) -> Iterator[Request]:
        """This tenant's waiting requests, newest first (the ones that ran or ended leave)."""
        line = self.lines.get(tenant) or deque()
        while line and not _waits(line[-1]):
            line.pop()
        return (r for r in reversed(line) if _waits(r))


def _waits(handle: Request) -> bool:
    return handle.status is Status.WAITING

"""GroupLost, the one failure a tensor-parallel worker does not survive. Apart from
worker/parallel/tensor_parallel.py so that the worker's loop (worker/main.py) can catch it without importing
torch: the fake worker runs that loop, and torch's import is most of its start-up."""


class GroupLost(BaseException):
    """A collective failed. A BaseException, so that the runner's per-step `except Exception`
    cannot turn it into one failed step: with a rank gone, the whole worker must go."""

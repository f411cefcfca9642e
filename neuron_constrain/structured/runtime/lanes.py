"""``Lanes``: compile work on two bounded thread pools by size, so a flood of large constraints
waits behind its own kind and never in front of small ones.

    lanes = Lanes(threads=2)                     # 2 threads for small constraints, 2 for large
    future = lanes.submit(size, fn, *args)       # size: the constraint's text length (bytes)
    lanes.shutdown(wait=False, cancel_futures=True)

A constraint of at most :data:`SMALL` bytes (an ordinary tool or response schema, a short
regex) compiles on the small lane; anything larger on the large lane. A flood of large
ones queues on its own threads while small ones keep theirs: each lane's compile time is
bounded (``limits.compile_seconds``), so a small request waits at most for the small
requests ahead of it. ``Lanes`` is a ``concurrent.futures.Executor`` whose ``submit`` takes
the size first; ``lane_of(size)`` names the lane.
"""
from __future__ import annotations

import concurrent.futures

SMALL = 8192  # bytes: MaskBench's and real tool schemas are mostly below this


class Lanes(concurrent.futures.Executor):
    def __init__(self, threads: int, *, small: int = SMALL, name: str = "grammar-compile"):
        self.small = small
        self.pools = {lane: concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-{lane}")
                      for lane in ("small", "large")}

    def lane_of(self, size: int) -> str:
        return "small" if size <= self.small else "large"

    def submit(self, size: int, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        return self.pools[self.lane_of(size)].submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)

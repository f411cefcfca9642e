"""``CountersFile``: the worker's counters as JSON, written by a thread ~50 ms after a step."""
from __future__ import annotations

import json
import logging
import os
import threading
import time

log = logging.getLogger("vllm.neuron_constrain")


_METRICS_PERIOD_S = 0.05  # the counters file trails the last step by about this much


class CountersFile:
    """The runner's counters as JSON at ``path``, rewritten (atomically) by a writer thread.

    ``notify()`` is all a step does: the thread wakes, waits ``period`` seconds (so a
    burst of steps costs one write) and writes ``snapshot()``. A failed write (the file's
    folder gone, a value JSON cannot encode, a bug in ``snapshot``) is logged with its
    type and the thread keeps serving later writes: the counters never take the engine down.
    """

    def __init__(self, path: str, snapshot, *, period: float = _METRICS_PERIOD_S):
        self.path = path
        self.snapshot = snapshot
        self.period = period
        self.failures = 0
        self._event = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self) -> None:
        data = self.snapshot()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)

    def notify(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nc-metrics", daemon=True)
            self._thread.start()
        self._event.set()

    def _loop(self) -> None:
        while True:
            self._event.wait()
            time.sleep(self.period)
            self._event.clear()
            try:
                self.write()
            except Exception as e:  # noqa: BLE001 - logged; the next step's write tries again
                self.failures += 1
                log.warning("neuron_constrain: could not write the counters file %s (%s: %s)",
                            self.path, type(e).__name__, e)

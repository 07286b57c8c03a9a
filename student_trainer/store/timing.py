"""Where a store's time goes: seconds per stage (D2H wait, hash, write, read, ...), summed over the
threads that spend it, for the bench's profile table. None where nobody asks: no cost then."""

from __future__ import annotations

import contextlib
import threading
import time


class StageTimes:
    def __init__(self):
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self.max_in_flight: dict[str, int] = {}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
            self.counts[stage] = self.counts.get(stage, 0) + 1

    @contextlib.contextmanager
    def stage(self, name: str):
        """Times the block; also counts how many threads are in it at once (`max_in_flight`)."""
        with self._lock:
            now = self._in_flight[name] = self._in_flight.get(name, 0) + 1
            self.max_in_flight[name] = max(self.max_in_flight.get(name, 0), now)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)
            with self._lock:
                self._in_flight[name] -= 1


def stage(times: StageTimes | None, name: str):
    """`times.stage(name)`, or nothing when `times` is None."""
    return times.stage(name) if times is not None else contextlib.nullcontext()

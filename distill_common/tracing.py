"""Per-batch timestamps along the data plane, for bench/transport_trace.py.

Off unless DISTILL_TRACE names a file prefix: then every `mark(event, batch_id)`
appends (CLOCK_MONOTONIC seconds, event, batch id) in memory, and the process
writes them to ``<prefix>.<pid>.tsv`` at exit. Teacher and student share the clock
(time.perf_counter is CLOCK_MONOTONIC on Linux), so their marks merge into one
timeline. When off, a mark is one global lookup and a return.
"""

from __future__ import annotations

import atexit
import os
import time

_PREFIX = os.environ.get("DISTILL_TRACE", "")
_events: list[tuple[float, str, int]] = []


def mark(event: str, batch_id: int) -> None:
    if _PREFIX:
        _events.append((time.perf_counter(), event, batch_id))


def dump() -> str:
    """Writes this process's marks (if tracing is on); returns the file's path or ""."""
    if not _events:
        return ""
    path = f"{_PREFIX}.{os.getpid()}.tsv"
    with open(path, "w") as f:
        f.writelines(f"{t:.6f}\t{event}\t{batch_id}\n" for t, event, batch_id in _events)
    return path


if _PREFIX:
    atexit.register(dump)

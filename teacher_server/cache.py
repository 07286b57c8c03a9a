"""Shared work: identical batches from several sessions are computed once.

Several students on one dataset, or the runs of a sweep, submit the same token ids.
Two levels save the teacher that work:

- *In one forward* (always on, costs nothing): when a plan holds identical batches
  from several sessions, the engine computes the first and serves the others from
  its rows.
- *Across time* (`--cache-bytes`, off by default): an LRU cache of what the forward
  produced for a batch, bounded in bytes. A later identical batch is served from it
  without a forward. Entries live in teacher memory on the teacher's device: the
  bound is taken from the room the forward has for activations.

An entry holds what the forward produced, not what one session asked for: the
logits in the teacher's dtype and what any live session's request needs of the
forward (the hidden states of the layers asked: distill_common.outputs.ForwardNeeds).
Each session's tensors (its dtype, its top-k, its layers) are derived from the entry
as from a fresh forward; an entry that lacks something a session needs is a miss.

Keys are a BLAKE2b digest of the token ids and the attention mask (their bytes,
shape and dtype; distill_common/wire.py: batch_key, which the data plane's per-batch
header uses too): two batches share a key only when the teacher would compute the
same thing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from distill_common.outputs import BatchOutputs, ForwardNeeds


@dataclass
class CacheStats:
    hits: int = 0  # batches served from the cache, no forward
    misses: int = 0  # batches computed while the cache was on
    evictions: int = 0  # entries dropped to stay within the bound
    shared_in_forward: int = 0  # batches served by an identical batch of the same forward
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


class OutputCache:
    """An LRU of BatchOutputs by batch key, at most `capacity_bytes` (0: off).

    Thread-safe: the engine thread looks up and inserts, the HTTP thread reads stats.
    """

    def __init__(self, capacity_bytes: int = 0):
        if capacity_bytes < 0:
            raise ValueError(f"cache capacity {capacity_bytes} must be >= 0 bytes")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, BatchOutputs] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = CacheStats(capacity_bytes=capacity_bytes)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def get(self, key: bytes, needs: ForwardNeeds = ForwardNeeds()) -> BatchOutputs | None:
        """The entry for `key` if it holds all that `needs` asks (counted as a hit);
        None otherwise. Misses are counted by `put`, when the batch has been computed."""
        if not self.enabled:
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.covers(needs):
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            return entry

    def put(self, key: bytes, outputs: BatchOutputs) -> BatchOutputs:
        """Records a computed batch (a miss) and keeps it, evicting the least recently
        used entries beyond the bound. Returns the outputs to serve from: the cache's
        own copy when kept, `outputs` itself otherwise."""
        if not self.enabled:
            return outputs
        size = outputs.nbytes
        with self._lock:
            self._stats.misses += 1
            if size > self.capacity_bytes:  # would evict everything and still not fit
                return outputs
        owned = outputs.detached()  # the copy is made outside the lock
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:  # a recompute with more layers replaces the entry
                self._bytes -= old.nbytes
            self._entries[key] = owned
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._stats.evictions += 1
        return owned

    def note_shared_in_forward(self, batches: int = 1) -> None:
        with self._lock:
            self._stats.shared_in_forward += batches

    def stats(self) -> CacheStats:
        with self._lock:
            s = self._stats
            return CacheStats(hits=s.hits, misses=s.misses, evictions=s.evictions,
                              shared_in_forward=s.shared_in_forward, entries=len(self._entries), bytes=self._bytes,
                              capacity_bytes=self.capacity_bytes)

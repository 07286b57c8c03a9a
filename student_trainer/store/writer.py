"""Rows gathered into shards and written on a thread of their own, off the forward's path."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from distill_common import store as fmt
from distill_common.store import StoreError
from student_trainer.store.directory import TeacherStore


@dataclass
class _Rows:
    keys: list[bytes]
    encoded: dict[str, torch.Tensor]  # codec name -> rows as stored before zstd (host, maybe in flight)
    tokens: int
    first_row: int | None
    ready: object = None  # a CUDA event after the copies to the host, or None
    out_of_range: torch.Tensor | None = None  # whether an id did not fit its bits (read once `ready`)


class ShardWriter:
    """Gathers encoded rows into shards of `rows_per_shard` and writes them, on a thread of its own.

    `add` takes a batch's rows encoded on their device (ids packed there), starts their copy to the
    host and returns; the thread waits for the copy, and writes a shard whenever enough rows are
    in. Rows not yet in a written shard are found with `pending` (write-through reads them back).
    A failed write is raised by the next `add` or by `close`.
    """

    def __init__(self, store: TeacherStore, rows_per_shard: int, *, dump: bool = False, max_queued: int = 4):
        self.store, self.rows_per_shard, self.dump = store, rows_per_shard, dump
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._pending: dict[bytes, tuple[_Rows, int]] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._write_rest = True
        self.shards_written = 0
        self.rows_written = 0
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    def add(self, keys: list[bytes], tensors: list[torch.Tensor], tokens: int, first_row: int | None = None,
            rows: list[int] | None = None) -> None:
        """The batch's layout tensors (`tensors`, in send order), its rows `rows` (default: all)."""
        self._raise_if_failed()
        encoded, out_of_range = {}, []
        for codec, tensor in zip(self.store.codecs, tensors):
            stored = codec.encode(tensor)
            if codec.bits:
                out_of_range.append(fmt.ids_out_of_range(tensor, codec.bits))
            if rows is not None:
                stored = stored[torch.tensor(rows, device=stored.device)]
            # On a GPU: into pinned memory, without waiting; the writer's thread waits for `ready`.
            encoded[codec.name] = stored.to("cpu", non_blocking=stored.is_cuda)
        bad = torch.stack(out_of_range).any().to("cpu", non_blocking=True) if out_of_range else None
        ready = None
        if any(t.is_cuda for t in tensors):
            ready = torch.cuda.Event()
            ready.record()
        item = _Rows(keys if rows is None else [keys[i] for i in rows], encoded, tokens, first_row, ready, bad)
        with self._lock:
            for index, key in enumerate(item.keys):
                self._pending.setdefault(key, (item, index))
        self._put(item)

    def is_pending(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending

    def pending(self, key: bytes) -> list[torch.Tensor] | None:
        """A row not yet in a written shard, decoded as a batch of one (None: not pending)."""
        with self._lock:
            found = self._pending.get(key)
        if found is None:
            return None
        item, index = found
        if item.ready is not None:
            item.ready.synchronize()
        return [codec.decode(item.encoded[codec.name][index:index + 1]) for codec in self.store.codecs]

    def _put(self, item) -> None:
        while True:
            try:
                self._queue.put(item, timeout=1.0)
                return
            except queue.Full:
                self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StoreError(f"writing a shard into {self.store.directory} failed: {self._error}") from self._error

    def _run(self) -> None:
        batches: list[_Rows] = []
        rows = 0
        while True:
            item = self._queue.get()
            try:
                if item is not None:
                    if item.ready is not None:
                        item.ready.synchronize()
                    if item.out_of_range is not None and bool(item.out_of_range):
                        raise StoreError(fmt.ids_error(fmt.id_bits(self.store.facts.vocab_size)))
                    batches.append(item)
                    rows += len(item.keys)
                if batches and (rows >= self.rows_per_shard or (item is None and self._write_rest)):
                    self._write(batches)
                    batches, rows = [], 0
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by add() / close()
                self._error = e
                return
            if item is None:
                return

    def _write(self, batches: list[_Rows]) -> None:
        keys = [key for item in batches for key in item.keys]
        rows = {codec.name: torch.cat([item.encoded[codec.name] for item in batches]) for codec in self.store.codecs}
        tokens = sum(item.tokens for item in batches)
        first_row = batches[0].first_row if self.dump else None
        self.store.write_shard(keys, rows, tokens, first_row)
        self.shards_written += 1
        self.rows_written += len(keys)
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)

    def close(self, timeout_s: float = 600.0, write_rest: bool = True) -> None:
        """Writes what is left as a last shard (unless not `write_rest`) and waits for the thread (at
        most `timeout_s`)."""
        if self._thread.is_alive():
            self._write_rest = write_rest
            self._put(None)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise StoreError(f"the store writer did not finish within {timeout_s:.0f}s ({self.store.directory})")
        self._raise_if_failed()

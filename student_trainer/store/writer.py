"""Rows gathered into shards and written on a thread of their own, off the forward's path."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from distill_common import store as fmt
from distill_common.store import StoreError
from student_trainer.store.directory import TeacherStore
from student_trainer.store.timing import stage

# The longest wait for the device to finish a batch's copy to the host.
COPY_TIMEOUT_S = 600.0


@dataclass
class _Rows:
    keys: list[bytes]
    encoded: dict[str, torch.Tensor]  # codec name -> rows as stored before zstd (host, maybe in flight)
    tokens: list[int]  # of each row
    first_row: int | None
    ready: object = None  # a CUDA event after the copies to the host, or None
    out_of_range: torch.Tensor | None = None  # whether an id did not fit its bits (read once `ready`)

    def part(self, begin: int, end: int) -> "_Rows":
        """Rows [begin, end) of these (views, no copy)."""
        return _Rows(self.keys[begin:end], {name: t[begin:end] for name, t in self.encoded.items()},
                     self.tokens[begin:end], None if self.first_row is None else self.first_row + begin)


class ShardWriter:
    """Gathers encoded rows into shards of `rows_per_shard` and writes them, on a thread of its own.

    `add` takes a batch's rows encoded on their device (ids packed there), starts their copy to the
    host (into pinned memory, recording an event) and returns: the forward's thread never waits
    for the device or the disk. The thread waits for the event and writes. A dump, which says how
    many rows it will add (`rows_total`), gets shards of exactly `rows_per_shard` rows (the last
    one the rest) and each batch is written into its shard's file as soon as it is on the host,
    so the write of a shard is spread over its batches and only the last batch's remains when the
    dump's last forward is done. Otherwise (write-through while training, zstd) rows are gathered
    and a shard written whenever `rows_per_shard` or more are in. Rows not yet in a written shard
    are found with `pending` (write-through reads them back). A failed write is raised by the next
    `add` or by `close`.
    """

    def __init__(self, store: TeacherStore, rows_per_shard: int, *, dump: bool = False, max_queued: int = 4,
                 rows_total: int | None = None):
        self.store, self.rows_per_shard, self.dump = store, rows_per_shard, dump
        self.times = store.times
        self._streaming = rows_total is not None and not any(codec.zstd_level for codec in store.codecs)
        self._rows_left = rows_total
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._pending: dict[bytes, tuple[_Rows, int]] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._write_rest = True
        self.shards_written = 0
        self.rows_written = 0
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    def add(self, keys: list[bytes], tensors: list[torch.Tensor], tokens: list[int], first_row: int | None = None,
            rows: list[int] | None = None) -> None:
        """The batch's layout tensors (`tensors`, in send order), its rows `rows` (default: all),
        `tokens`: the tokens of each of those rows."""
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
        with stage(self.times, "forward thread: blocked on the writer's queue"):
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
        _wait_for_copy(item)
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
        gathered: list[_Rows] = []  # rows not yet written (into the open file, when streaming)
        shard: fmt.ShardFile | None = None
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    if gathered and self._write_rest:
                        if self._streaming:
                            raise StoreError(f"the dump added {sum(len(i.keys) for i in gathered)} rows fewer than "
                                             "it said it would (rows_total)")
                        self._write(gathered)
                    return
                with stage(self.times, "writer: waiting for the device's copy"):
                    _wait_for_copy(item)
                if item.out_of_range is not None and bool(item.out_of_range):
                    raise StoreError(fmt.ids_error(fmt.id_bits(self.store.facts.vocab_size)))
                if not self._streaming:
                    gathered.append(item)
                    if sum(len(i.keys) for i in gathered) >= self.rows_per_shard:
                        self._write(gathered)
                        gathered = []
                    continue
                while item is not None and len(item.keys):
                    if shard is None:
                        shard_rows = min(self.rows_per_shard, self._rows_left)
                        if shard_rows <= 0:
                            raise StoreError("the dump added more rows than it said it would (rows_total)")
                        shard = self.store.shard_file(shard_rows)
                    room = shard_rows - sum(len(i.keys) for i in gathered)
                    part, item = (item, None) if len(item.keys) <= room else (
                        item.part(0, room), item.part(room, len(item.keys)))
                    with stage(self.times, "writer: write + sha256 (file, rows) + fdatasync (as batches come)"):
                        for codec in self.store.codecs:
                            shard.put(codec.name, part.encoded[codec.name])
                        shard.sync()
                    gathered.append(part)
                    if room == len(part.keys):
                        self._commit(shard, gathered)
                        self._rows_left -= shard_rows
                        shard, gathered = None, []
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by add() / close()
            self._error = e
        finally:
            if shard is not None:
                shard.abort()  # an unfinished shard is not part of the store: a resumed dump writes it whole

    def _write(self, batches: list[_Rows]) -> None:
        keys = [key for item in batches for key in item.keys]
        rows = {codec.name: [item.encoded[codec.name] for item in batches] for codec in self.store.codecs}
        tokens = sum(sum(item.tokens) for item in batches)
        first_row = batches[0].first_row if self.dump else None
        self.store.write_shard(keys, rows, tokens, first_row)
        self._written(keys)

    def _commit(self, shard: fmt.ShardFile, parts: list[_Rows]) -> None:
        keys = [key for part in parts for key in part.keys]
        self.store.commit_shard(shard, keys, sum(sum(part.tokens) for part in parts),
                                parts[0].first_row if self.dump else None)
        self._written(keys)

    def _written(self, keys: list[bytes]) -> None:
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


def _wait_for_copy(item: _Rows) -> None:
    """Until the device has copied `item`'s rows to the host (polled: a CUDA event has no timeout)."""
    if item.ready is None:
        return
    deadline = time.monotonic() + COPY_TIMEOUT_S
    while not item.ready.query():
        if time.monotonic() > deadline:
            raise StoreError(f"the device did not copy a batch's outputs to the host within {COPY_TIMEOUT_S:.0f}s")
        time.sleep(0.0005)

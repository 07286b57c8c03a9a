"""Teacher outputs computed once: a store on disk that the trainer reads like a live teacher.

    student-trainer dump --teacher HOST:PORT --tokenizer DIR --data train.jsonl --topk 64 \\
        --teacher-outputs store/                       # or --model DIR: the teacher in this process
    student-trainer train --teacher-outputs store/ --topk 64 --model ... --data train.jsonl

The format (safetensors shards, a JSON manifest, ids packed to the vocabulary's bits) is
distill_common/store.py's. Here:

- `TeacherStore`: one store directory: its manifest checked against what a run asks (the data,
  the packing, the outputs, the teacher), the index from a row's key to where it lies, rows
  read from memory-mapped shards (each shard's digest checked the first time it is read) and
  shards written (under a temporary name, synced, renamed, then named in the manifest).
- `ShardWriter`: rows gathered into shards by a thread of its own, so that a dump's forwards
  never wait for a write.
- `StoreTeacher`: the trainer's third source of teacher outputs, beside `TeacherClient` and
  `LocalTeacher`, with their interface (`submit` -> a future of a `TeacherOutput`, `info`,
  `joined`, `outputs`, `close`): rows are read by a thread of its own, off the training
  thread. Rows are found by their key (the digest of their ids and mask), so whatever batches
  a rank draws (its share under DDP, after an exact `--resume`, the HF Trainer's) it reads
  them. With a teacher as well (`--teacher-outputs` and `--teacher`), a batch with rows the
  store lacks is asked of the teacher and its missing rows are written through.
- `dump`: `student-trainer dump`: the trainer's own data pipeline (student_trainer/data.py),
  rows in order, batch by batch, from a served teacher or one loaded in this process; killed
  and started again it continues after the last complete shard and writes the same bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from distill_common import store as fmt
from distill_common import wire
from distill_common.outputs import (FinalHidden, JoinData, Output, OutputHead, OutputRequest, SubsetLogits,
                                    TeacherFacts, TeacherOutput, output_spec)
from distill_common.store import StoreCorrupt, StoreError, StoreMismatch, StoreMissing

log = logging.getLogger(__name__)

__all__ = ["TeacherStore", "ShardWriter", "StoreTeacher", "StoreError", "StoreCorrupt", "StoreMismatch",
           "StoreMissing", "open_store_teacher", "dump"]


@dataclass
class StoreInfo:
    """What a store says of its teacher, as `TeacherClient.info` says it of a live one."""

    model_name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: str
    tokenizer_fingerprint: str
    max_batch_tokens: int = 0
    max_seq_len: int = 0


def data_facts(dataset, data_path: str | Path) -> dict:
    """What the manifest records of the data a store's rows come from."""
    return {"file": str(data_path), "sha256": fmt.sha256_of(Path(data_path)), "fingerprint": dataset.fingerprint,
            "rows": len(dataset), "seq_len": dataset.seq_len, "pack_mode": dataset.mode}


def teacher_facts(source, model_name: str, architecture: str = "", quantization: str = "") -> dict:
    """What the manifest records of the teacher: its model, dtype, quantization ("" when it does
    not report one) and what its outputs' shapes depend on (TeacherFacts)."""
    facts = source.outputs.teacher
    return {"model": model_name, "architecture": architecture, "dtype": wire.dtype_name(facts.dtype),
            "quantization": quantization, "tokenizer_fingerprint": facts.tokenizer_fingerprint,
            "facts": fmt.facts_to_json(facts)}


# ---- one store directory -------------------------------------------------------------------------


# Shards whose memory-mapped readers stay open at once (one file descriptor each).
OPEN_SHARDS = 64


@dataclass
class _Shard:
    path: Path
    entry: dict
    verified: bool = False  # its digest was checked


class TeacherStore:
    """A store directory: its manifest, its index, its rows (see the module's docstring)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        manifest = fmt.read_manifest(self.directory)
        if manifest is None:
            raise StoreMissing(f"{self.directory / fmt.MANIFEST} does not exist: dump the teacher's outputs first "
                               "(student-trainer dump --teacher-outputs DIR ...), or give --teacher too to fill the "
                               "store while training")
        self.manifest = manifest
        try:
            outputs = manifest["outputs"]
            self.facts: TeacherFacts = fmt.facts_from_json(manifest["teacher"]["facts"])
            spec = fmt.spec_from_json(outputs["spec"])
            self.request = OutputRequest.resolve(spec, self.facts)
            self.seq_len = int(manifest["data"]["seq_len"])
            self.codecs = fmt.codecs_for(self.request, self.seq_len, pack=outputs["pack_ids"],
                                         zstd_level=int(outputs["zstd_level"]))
        except (KeyError, TypeError, ValueError) as e:
            raise StoreCorrupt(f"{self.directory / fmt.MANIFEST}: malformed ({type(e).__name__}: {e})") from e
        if [codec.to_json() for codec in self.codecs] != outputs["tensors"]:
            raise StoreCorrupt(f"{self.directory / fmt.MANIFEST}: its tensors {outputs['tensors']} are not what its "
                               f"outputs ({self.request}) store")
        self._lock = threading.Lock()  # the index and the shards, read by one thread, added to by another
        self.shards: list[_Shard] = []
        self.index: dict[bytes, tuple[int, int]] = {}
        self._handles: dict[int, object] = {}  # shard number -> its open reader, least recently read first
        self.head = self._read_head()
        self._manifest_mtime_ns = 0
        self._add_shards(manifest["shards"])

    # ---- what the store holds --------------------------------------------------------------

    @property
    def rows(self) -> int:
        return sum(shard.entry["rows"] for shard in self.shards)

    @property
    def info(self) -> StoreInfo:
        teacher = self.manifest["teacher"]
        return StoreInfo(model_name=teacher["model"], architecture=teacher.get("architecture", ""),
                         vocab_size=self.facts.vocab_size, hidden_size=self.facts.hidden_size,
                         num_layers=self.facts.num_layers, dtype=teacher["dtype"],
                         tokenizer_fingerprint=self.facts.tokenizer_fingerprint)

    def _read_head(self) -> OutputHead | None:
        entry = self.manifest.get("head")
        if not entry:
            return None
        path = self.directory / entry["file"]
        self._check_file(path, entry)
        from safetensors.torch import load_file

        tensors = load_file(path)
        joined = self.request.join_assemble([tensors[f"join.{i}"] for i in range(len(tensors))])
        return joined.head

    def _check_file(self, path: Path, entry: dict, *, digest: bool = True) -> None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StoreCorrupt(f"{path} is missing: {self.directory / fmt.MANIFEST} names it ({entry['bytes']} "
                               "bytes); the store is incomplete (dump it again into a new directory)") from None
        if size != entry["bytes"]:
            raise StoreCorrupt(f"{path} has {size} bytes, the manifest records {entry['bytes']}: the file is "
                               f"{'truncated' if size < entry['bytes'] else 'longer than written'}; nothing of it is "
                               "read (dump it again into a new directory)")
        if digest and fmt.sha256_of(path) != entry["sha256"]:
            raise StoreCorrupt(f"{path}: its sha256 differs from the one {self.directory / fmt.MANIFEST} records: "
                               "the file changed after it was written (a flipped byte, a copy gone wrong); nothing of "
                               "it is read (dump it again into a new directory)")

    def _add_shards(self, entries: list[dict]) -> None:
        from safetensors import safe_open

        for entry in entries[len(self.shards):]:
            path = self.directory / entry["file"]
            self._check_file(path, entry, digest=False)  # sizes at once; digests at a shard's first read
            try:
                with safe_open(path, "pt") as handle:
                    keys = handle.get_tensor(fmt.ROW_KEY)
            except Exception as e:  # noqa: BLE001 - safetensors' own error types differ between versions
                raise StoreCorrupt(f"{path}: not a shard this store wrote ({type(e).__name__}: {e}); nothing of it "
                                   "is read (dump it again into a new directory)") from e
            if hashlib.sha256(keys.numpy().tobytes()).hexdigest() != entry["row_keys_sha256"]:
                raise StoreCorrupt(f"{path}: its row keys differ from what {self.directory / fmt.MANIFEST} records "
                                   "(row_keys_sha256): the file changed after it was written")
            number = len(self.shards)
            self.shards.append(_Shard(path, entry))
            for row, key in enumerate(keys.numpy()):
                self.index.setdefault(key.tobytes(), (number, row))

    def refresh(self) -> None:
        """Takes in the shards written since this store was opened (by another rank, say)."""
        changed = (self.directory / fmt.MANIFEST).stat().st_mtime_ns
        if changed == self._manifest_mtime_ns:
            return
        self._manifest_mtime_ns = changed
        manifest = fmt.read_manifest(self.directory)
        with self._lock:
            if manifest is not None and len(manifest["shards"]) > len(self.shards):
                self.manifest["shards"] = manifest["shards"]
                self._add_shards(manifest["shards"])

    def locate(self, keys: list[bytes]) -> list[tuple[int, int] | None]:
        with self._lock:
            return [self.index.get(key) for key in keys]

    # ---- checks against what a run asks ----------------------------------------------------

    def check_data(self, dataset, data_path: str | Path) -> None:
        """StoreMismatch naming what differs when `dataset` is not the data the rows come from."""
        stored, manifest_path = self.manifest["data"], self.directory / fmt.MANIFEST
        if stored["fingerprint"] in (None, dataset.fingerprint):
            return  # the same data, or rows from batches of no data file (the HF Trainer's): found by their keys
        differs = []
        if stored["seq_len"] != dataset.seq_len:
            differs.append(f"--seq-len {stored['seq_len']} there, {dataset.seq_len} here")
        if stored["pack_mode"] != dataset.mode:
            differs.append(f"--pack-mode {stored['pack_mode']} there, {dataset.mode} here")
        digest = fmt.sha256_of(Path(data_path))
        if stored["sha256"] != digest:
            differs.append(f"the data file: {stored['file']} (sha256 {stored['sha256'][:12]}) there, {data_path} "
                           f"(sha256 {digest[:12]}) here")
        if not differs:
            differs.append("the tokenized examples (another tokenizer?)")
        raise StoreMismatch(f"{manifest_path} was dumped from other data: {'; '.join(differs)}. Train on the data and "
                            "settings it was dumped with, or dump again into a new directory")

    def check_outputs(self, asked: OutputRequest) -> None:
        """StoreMismatch when the store cannot give what `asked` asks (a kind it lacks, another dtype)."""
        stored = set(self.request.kinds)
        missing = [kind for kind in asked if kind not in stored and not self._derivable(kind)]
        problems = []
        if missing:
            problems.append(f"this run asks for {', '.join(map(str, missing))}, which it does not hold")
        if asked.dtype != self.request.dtype:
            problems.append(f"this run asks for them in {wire.dtype_name(asked.dtype)}, it holds "
                            f"{wire.dtype_name(self.request.dtype)}")
        if problems:
            raise StoreMismatch(f"{self.directory / fmt.MANIFEST} holds {self.request}: {'; '.join(problems)}. Dump "
                                "what this run asks into a new directory, or train with the outputs it holds")

    def _derivable(self, kind: Output) -> bool:
        # An EAGLE-3 draft's subset logits come from the final hidden state and the head's rows.
        return isinstance(kind, SubsetLogits) and FinalHidden() in set(self.request.kinds) and self.head is not None

    def check_teacher(self, request: OutputRequest, model_name: str) -> None:
        """StoreMismatch when a live teacher (to write through) is not the one the store was made with."""
        theirs, ours = request.teacher, self.facts
        differs = [f"{name} {getattr(ours, name)} there, {getattr(theirs, name)} here"
                   for name in ("vocab_size", "hidden_size", "num_layers", "dtype", "tokenizer_fingerprint")
                   if getattr(theirs, name) != getattr(ours, name)]
        if request.kinds != self.request.kinds or request.dtype != self.request.dtype:
            differs.append(f"outputs {self.request} there, {request} here")
        if model_name != self.manifest["teacher"]["model"]:
            differs.append(f"model {self.manifest['teacher']['model']} there, {model_name} here")
        if differs:
            raise StoreMismatch(f"{self.directory / fmt.MANIFEST} was made with another teacher or outputs than the "
                                f"one given to fill it: {'; '.join(differs)}. Give the same teacher, or a new "
                                "directory")

    # ---- reading rows ----------------------------------------------------------------------

    def _open(self, number: int):
        """The shard's memory-mapped reader; its digest is checked the first time. At most
        OPEN_SHARDS stay open (a store of thousands of shards would run out of file descriptors)."""
        shard = self.shards[number]
        if not shard.verified:
            self._check_file(shard.path, shard.entry)
            shard.verified = True
        handle = self._handles.pop(number, None)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(shard.path, "pt")
            if len(self._handles) >= OPEN_SHARDS:
                self._handles.pop(next(iter(self._handles)))  # the least recently read; closed when collected
        self._handles[number] = handle
        return handle

    def read(self, locations: list[tuple[int, int]], device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """The rows at `locations` as the layout's tensors of one batch, on `device` (ids unpacked
        there: on a GPU the unpacking costs the host nothing)."""
        return [codec.decode(stored.to(device, non_blocking=True))
                for codec, stored in zip(self.codecs, self.read_stored(locations))]

    def read_stored(self, locations: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The rows at `locations` as stored (before unpacking), one tensor per codec, on the host."""
        columns: list[list[torch.Tensor]] = [[] for _ in self.codecs]
        for number, row in locations:
            handle = self._open(number)
            for column, codec in zip(columns, self.codecs):
                if codec.zstd_level:
                    offsets = handle.get_slice(f"{codec.name}.offsets")[row:row + 2].tolist()
                    frame = handle.get_slice(codec.name)[offsets[0]:offsets[1]].numpy().tobytes()
                    column.append(fmt.decompress_row(frame, codec))
                else:
                    column.append(handle.get_slice(codec.name)[row:row + 1])
        return [torch.cat(column) for column in columns]

    # ---- writing rows ----------------------------------------------------------------------

    def write_shard(self, keys: list[bytes], rows: dict[str, torch.Tensor], tokens: int,
                    first_row: int | None = None, number: int | None = None) -> dict:
        """One shard of `rows` (each codec's encoded rows, on the host), written and then named in the
        manifest. `number`: the shard's place (a dump's; None: the next). Returns its manifest entry."""
        tensors = {fmt.ROW_KEY: torch.tensor([list(key) for key in keys], dtype=torch.uint8)}
        for codec in self.codecs:
            stored = rows[codec.name]
            if codec.zstd_level:
                tensors[codec.name], tensors[f"{codec.name}.offsets"] = fmt.compress_rows(stored, codec.zstd_level)
            else:
                tensors[codec.name] = stored
        data = fmt.serialize_shard(tensors)
        entry = {"rows": len(keys), "tokens": int(tokens), "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest(),
                 "row_keys_sha256": hashlib.sha256(tensors[fmt.ROW_KEY].numpy().tobytes()).hexdigest()}
        if first_row is not None:
            entry["first_row"] = first_row
        with fmt.locked(self.directory):
            manifest = fmt.read_manifest(self.directory)
            number = len(manifest["shards"]) if number is None else number
            if number != len(manifest["shards"]):
                raise StoreError(f"{self.directory}: shard {number} would not follow the manifest's "
                                 f"{len(manifest['shards'])} shards (another dump writing into the same directory?)")
            entry = {"file": f"shard-{number:06d}.safetensors", **entry}
            fmt.write_atomic(self.directory / entry["file"], data)  # complete before the manifest names it
            manifest["shards"].append(entry)
            fmt.write_manifest(self.directory, manifest)
        with self._lock:
            self.manifest["shards"] = manifest["shards"]
            self._add_shards(manifest["shards"])
        return entry

    @staticmethod
    def create(directory: str | Path, request: OutputRequest, *, teacher: dict, data: dict,
               pack_ids: bool = True, zstd_level: int = 0, head: JoinData | None = None,
               dump: dict | None = None, exist_ok: bool = False) -> None:
        """A new, empty store: its manifest (and the head, once). Refuses a directory that holds one,
        unless `exist_ok` (several ranks creating the same store: the first does, the others open
        it and check it against their run)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if zstd_level:
            fmt.zstd_module()  # refused now, not at the first shard
        if any(isinstance(kind, Output) and kind.batch_field for kind in request):
            raise StoreError(f"{request} reads data the student sends with each batch (ids to score), which change "
                             "every step: it cannot be stored")
        codecs = fmt.codecs_for(request, data["seq_len"], pack=pack_ids, zstd_level=zstd_level)
        manifest = {"format": fmt.FORMAT, "teacher": teacher,
                    "outputs": {"spec": fmt.spec_to_json(output_spec(request.kinds, wire.dtype_name(request.dtype))),
                                "kinds": [str(kind) for kind in request], "dtype": wire.dtype_name(request.dtype),
                                "pack_ids": pack_ids, "zstd_level": zstd_level,
                                "tensors": [codec.to_json() for codec in codecs]},
                    "data": data, "dump": dump, "head": None, "shards": []}
        with fmt.locked(directory):
            if fmt.read_manifest(directory) is not None:
                if exist_ok:
                    return
                raise StoreError(f"{directory / fmt.MANIFEST} exists already")
            join_tensors = request.join_derive(head) if head is not None and request.join_layout() else []
            if join_tensors:
                data_bytes = fmt.serialize_shard({f"join.{i}": t.detach().cpu() for i, t in enumerate(join_tensors)})
                fmt.write_atomic(directory / fmt.HEAD_FILE, data_bytes)
                manifest["head"] = {"file": fmt.HEAD_FILE, "bytes": len(data_bytes),
                                    "sha256": hashlib.sha256(data_bytes).hexdigest()}
            fmt.write_manifest(directory, manifest)


# ---- writing shards off the forward's path -----------------------------------------------------


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


# ---- the trainer's source ---------------------------------------------------------------------


class StoreTeacher:
    """Teacher outputs read from a store, with TeacherClient's interface (see the module's docstring)."""

    def __init__(self, store: TeacherStore, device: str | torch.device, asked: OutputRequest, *,
                 teacher=None, model_name: str = "", rows_per_shard: int = 256, record_reads: bool = False,
                 timeout_s: float = 900.0):
        """`asked`: the outputs the run reads (resolved against the store's teacher). `teacher`: a
        TeacherClient or LocalTeacher asked for what the store lacks, which is written through.
        `record_reads`: keep where every row read lay (`read_locations`, for tests). `timeout_s`: the
        longest wait for the teacher's outputs of one batch to write through."""
        self.store = store
        self.device = torch.device(device)
        self.outputs = asked
        self.address = f"the store {store.directory}" + (f" (and the teacher at {teacher.address})"
                                                         if getattr(teacher, "address", None) else "")
        self.info = store.info
        head = store.head
        self.joined = JoinData(head=None if head is None else OutputHead(
            head.weight.to(self.device), None if head.bias is None else head.bias.to(self.device),
            head.final_logit_softcapping, head.logit_scale))
        self.teacher, self.timeout_s = teacher, timeout_s
        if teacher is not None:
            store.check_teacher(teacher.outputs, model_name)
        self.writer = ShardWriter(store, rows_per_shard) if teacher is not None else None
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-read")
        self._next_batch_id = 0
        self.record_reads = record_reads
        self.read_locations: list[tuple[str, int]] = []  # (shard file, row) of every row read, with record_reads
        self.rows_read = 0
        self._through: set[bytes] = set()  # rows asked of the teacher, not yet handed to the writer
        self.batches_from_teacher = 0
        self.rows_written_through = 0
        self._closed = False

    def submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               timeout_s: float | None = None, *, score_ids: torch.Tensor | None = None) -> Future:
        """A future of the batch's TeacherOutput, read from the store (or, for rows it lacks, computed
        by the teacher and written through)."""
        if self._closed:
            raise StoreError(f"{self.address} is closed")
        if score_ids is not None:
            raise StoreError("a store holds no outputs at ids the student chooses each step (score_ids)")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        if input_ids.shape[1] != self.store.seq_len:
            raise StoreMismatch(f"{self.store.directory / fmt.MANIFEST} holds rows of {self.store.seq_len} tokens, this "
                                f"batch has {input_ids.shape[1]}: train with the --seq-len it was dumped with")
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        keys = [fmt.row_key(input_ids[row], mask[row]) for row in range(input_ids.shape[0])]
        batch_id, self._next_batch_id = self._next_batch_id, self._next_batch_id + 1
        locations = self.store.locate(keys)
        pending = [False] * len(keys)
        if self.writer is not None:
            # Asked of the teacher for an earlier batch, or written through and not yet in a shard: the
            # reader thread, which runs the batches in order, finds them in the writer or the store.
            pending = [where is None and (key in self._through or self.writer.is_pending(key))
                       for key, where in zip(keys, locations)]
        missing = [i for i, (where, held) in enumerate(zip(locations, pending)) if where is None and not held]
        if missing:
            self.store.refresh()  # another rank may have written them
            locations = self.store.locate(keys)
            missing = [i for i in missing if locations[i] is None]
        if missing and self.teacher is None:
            future: Future = Future()
            future.set_exception(StoreMissing(
                f"{self.store.directory} lacks {len(missing)} of this batch's {len(keys)} rows (the store holds "
                f"{self.store.rows} rows): dump the data this run trains on, or give --teacher too to compute and "
                "write what it lacks"))
            return future
        if missing:
            self._through.update(keys[i] for i in missing)
            live = self.teacher.submit(input_ids, mask)
            self.batches_from_teacher += 1
            tokens = int(mask[missing].sum())
            return self._reader.submit(self._write_through, batch_id, live, keys, missing, tokens)
        return self._reader.submit(self._read, batch_id, keys, locations, pending)

    def _read(self, batch_id: int, keys, locations, pending) -> TeacherOutput:
        held: list = [None] * len(keys)  # rows written through and not yet in a shard
        if any(pending):
            held = [self.writer.pending(key) if is_pending else None for key, is_pending in zip(keys, pending)]
            # The writer takes a row out of its pending ones once its shard is in the index.
            located = self.store.locate(keys)
            locations = [None if row is not None else where or located[i]
                         for i, (where, row) in enumerate(zip(locations, held))]
            lost = sum(where is None and row is None for where, row in zip(locations, held))
            if lost:
                raise StoreMissing(f"{lost} rows of this batch were to come from the teacher with an earlier batch, "
                                   "which failed (see its error)")
        stored = [where for where in locations if where is not None]
        tensors = self.store.read(stored, self.device) if stored else None
        if any(row is not None for row in held):
            parts, next_stored = [], 0
            for where, row in zip(locations, held):
                if where is not None:
                    parts.append([t.narrow(c.batch_axis, next_stored, 1) for c, t in zip(self.store.codecs, tensors)])
                    next_stored += 1
                else:
                    parts.append([t.to(self.device) for t in row])
            tensors = [torch.cat(column, dim=codec.batch_axis) for codec, column in zip(self.store.codecs, zip(*parts))]
        self.rows_read += len(locations)
        if self.record_reads:
            self.read_locations.extend((self.store.shards[number].entry["file"], row) for number, row in stored)
        return self._assemble(batch_id, tensors)

    def _write_through(self, batch_id: int, live: Future, keys, missing, tokens) -> TeacherOutput:
        try:
            out = live.result(timeout=self.timeout_s)
            self.writer.add(keys, self.store.request.disassemble(out), tokens, rows=missing)
        finally:
            self._through.difference_update(keys[i] for i in missing)
        self.rows_written_through += len(missing)
        out.batch_id = batch_id
        return out

    def _assemble(self, batch_id: int, tensors: list[torch.Tensor]) -> TeacherOutput:
        fields, start = {}, 0
        stored = {kind: None for kind in self.store.request}
        for kind in self.store.request:
            count = len(kind.layout(1, 1, self.store.facts, self.store.request.dtype))
            stored[kind] = tensors[start:start + count]
            start += count
        for kind in self.outputs:
            if kind in stored:
                fields.update(kind.assemble(stored[kind]))
            else:  # derivable (TeacherStore._derivable): subset logits from the final hidden state
                (final_hidden,) = stored[FinalHidden()]
                fields["subset_logits"] = self._subset_head(kind).logits(final_hidden, self.outputs.dtype)
        return TeacherOutput(batch_id=batch_id, **fields)

    def _subset_head(self, kind: SubsetLogits) -> OutputHead:
        heads = self.__dict__.setdefault("_subset_heads", {})
        if kind not in heads:
            head, ids = self.joined.head, torch.tensor(kind.token_ids, device=self.device)
            heads[kind] = OutputHead(head.weight[ids], None if head.bias is None else head.bias[ids],
                                     head.final_logit_softcapping, head.logit_scale)
        return heads[kind]

    def close(self, timeout_s: float | None = None) -> None:
        """Waits for the reads submitted, writes what was written through, and closes the teacher."""
        if self._closed:
            return
        self._closed = True
        self._reader.shutdown(wait=True)
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            if self.teacher is not None and hasattr(self.teacher, "close"):
                self.teacher.close(timeout_s=timeout_s)

    def __enter__(self) -> "StoreTeacher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_store_teacher(directory: str | Path, device, outputs: Iterable[Output], *, dtype: str | None = None,
                       dataset=None, data_path: str | Path | None = None, tokenizer=None, vocab_size: int = 0,
                       teacher=None, model_name: str = "", rows_per_shard: int = 256,
                       seq_len: int | None = None, record_reads: bool = False,
                       timeout_s: float = 900.0) -> StoreTeacher:
    """The trainer's StoreTeacher over `directory`, checked against the run: its data (`dataset`
    read from `data_path`), the outputs it asks (`outputs` in `dtype`, None: whatever the store
    holds), the student's vocabulary and tokenizer, and the `teacher` that fills what it lacks
    (TeacherClient or LocalTeacher; then a missing store is created from it, for rows of the
    dataset's length or, without a dataset, of `seq_len`)."""
    from distill_common.vocab import tokenizer_fingerprint

    directory = Path(directory)
    if teacher is not None and fmt.read_manifest(directory) is None:
        if dataset is not None:
            data = data_facts(dataset, data_path)
        elif seq_len:  # rows from elsewhere (the HF Trainer's batches): only their length is known
            data = {"file": None, "sha256": None, "fingerprint": None, "rows": None, "seq_len": seq_len,
                    "pack_mode": None}
        else:
            raise StoreError(f"{directory} holds no store to fill: the length of its rows is needed (seq_len)")
        TeacherStore.create(directory, teacher.outputs, teacher=teacher_facts(teacher, model_name), data=data,
                            head=teacher.joined, exist_ok=True)
    store = TeacherStore(directory)
    if dataset is not None:
        store.check_data(dataset, data_path)
    spec = output_spec(outputs, dtype or wire.dtype_name(store.request.dtype))
    try:
        asked = OutputRequest.resolve(spec, store.facts)
    except ValueError as e:
        raise StoreMismatch(f"{directory / fmt.MANIFEST}: the outputs this run asks are not what its teacher can "
                            f"give: {e}") from e
    store.check_outputs(asked)
    try:
        asked.check_student(vocab_size, tokenizer_fingerprint(tokenizer) if tokenizer is not None else "")
    except ValueError as e:
        raise StoreMismatch(f"{directory / fmt.MANIFEST}: {e}") from e
    return StoreTeacher(store, device, asked, teacher=teacher, model_name=model_name, rows_per_shard=rows_per_shard,
                        record_reads=record_reads, timeout_s=timeout_s)


# ---- student-trainer dump ----------------------------------------------------------------------


@dataclass
class DumpResult:
    rows: int  # rows in the store's dump shards
    rows_written: int  # by this run
    shards_written: int
    seconds: float
    tokens_written: int = 0
    resumed_at_row: int = 0


def dump(cfg) -> DumpResult:
    """`student-trainer dump`: every row of the data, in order, batch by batch, into the store
    (see the module's docstring). Continues after the last complete shard of an earlier dump
    with the same settings; refuses one with other settings."""
    from transformers import AutoTokenizer

    from student_trainer.data import PackedDataset
    from student_trainer.train import set_up_rank

    _, _, device, _, directory = set_up_rank(cfg.device, cfg.teacher_outputs, 0)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
    dataset = PackedDataset(cfg.data, tokenizer, cfg.seq_len, mode=cfg.pack_mode, skip_bad_lines=cfg.skip_bad_lines)
    teacher, model_name, quantization, architecture = _dump_teacher(cfg, device, tokenizer)
    try:
        settings = {"batch_size": cfg.batch_size, "rows_per_shard": cfg.rows_per_shard}
        if fmt.read_manifest(directory) is None:
            TeacherStore.create(directory, teacher.outputs,
                                teacher=teacher_facts(teacher, model_name, architecture, quantization),
                                data=data_facts(dataset, cfg.data), pack_ids=not cfg.raw_ids,
                                zstd_level=cfg.zstd_level, head=teacher.joined, dump=settings)
        store = TeacherStore(directory)
        store.check_data(dataset, cfg.data)
        store.check_teacher(teacher.outputs, model_name)
        stored = store.manifest
        if (stored["dump"] != settings or stored["outputs"]["pack_ids"] != (not cfg.raw_ids)
                or stored["outputs"]["zstd_level"] != cfg.zstd_level):
            raise StoreMismatch(
                f"{directory / fmt.MANIFEST} was dumped with {stored['dump']}, pack_ids "
                f"{stored['outputs']['pack_ids']}, zstd_level {stored['outputs']['zstd_level']}; this dump asks "
                f"{settings}, pack_ids {not cfg.raw_ids}, zstd_level {cfg.zstd_level}: continue it with the same "
                "settings, or dump into a new directory")
        shards = stored["shards"]
        if any("first_row" not in entry for entry in shards):
            raise StoreMismatch(f"{directory} holds rows written through by training: dump into a new directory")
        for shard in store.shards:  # what a resumed dump continues must be intact
            store._check_file(shard.path, shard.entry)
        start_row = sum(entry["rows"] for entry in shards)
        if start_row:
            log.info("continuing the dump in %s after row %d (%d complete shards)", directory, start_row, len(shards))
        result = dump_rows(teacher, store, dataset.input_ids, dataset.attention_mask, batch_size=cfg.batch_size,
                           rows_per_shard=cfg.rows_per_shard, start_row=start_row, prefetch=cfg.prefetch,
                           timeout_s=cfg.teacher_timeout_s)
        log.info("dumped %d rows (%d tokens) in %d shards to %s in %.1fs", result.rows_written, result.tokens_written,
                 result.shards_written, directory, result.seconds)
        return result
    finally:
        if hasattr(teacher, "close"):
            teacher.close(timeout_s=5)


def dump_rows(teacher, store: TeacherStore, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
              batch_size: int, rows_per_shard: int, start_row: int = 0, prefetch: int = 2,
              timeout_s: float = 600.0) -> DumpResult:
    """Rows `start_row`.. of `input_ids` / `attention_mask` [N, S], in order, `batch_size` at a
    time, from `teacher` (TeacherClient or LocalTeacher) into `store`'s dump shards.

    `prefetch` batches are asked ahead of the one written (a served teacher computes while this
    process writes); each batch's outputs are encoded on their device (ids packed there) and
    handed to the ShardWriter, whose thread copies them to the host and writes: the next forward
    never waits for a write."""
    writer = ShardWriter(store, rows_per_shard, dump=True)
    started, tokens = time.perf_counter(), 0
    inflight: list[tuple[int, int, Future]] = []

    def drain(keep: int) -> None:
        nonlocal tokens
        while len(inflight) > keep:
            begin, end, future = inflight.pop(0)
            out = future.result(timeout=timeout_s)
            keys = [fmt.row_key(input_ids[row], attention_mask[row]) for row in range(begin, end)]
            batch_tokens = int(attention_mask[begin:end].sum())
            writer.add(keys, store.request.disassemble(out), batch_tokens, first_row=begin)
            tokens += batch_tokens

    try:
        for begin in range(start_row, len(input_ids), batch_size):
            end = min(begin + batch_size, len(input_ids))
            inflight.append((begin, end, teacher.submit(input_ids[begin:end], attention_mask[begin:end])))
            drain(prefetch)
        drain(0)
    except BaseException:
        # The rows of an unfinished shard are not written: a dump started again writes that shard
        # whole, so its shards stay those of an uninterrupted dump.
        writer.close(write_rest=False)
        raise
    writer.close()
    return DumpResult(rows=store.rows, rows_written=writer.rows_written, shards_written=writer.shards_written,
                      seconds=time.perf_counter() - started, tokens_written=tokens, resumed_at_row=start_row)


def _dump_teacher(cfg, device: torch.device, tokenizer):
    """The teacher a dump asks: a TeacherClient to `--teacher`, or `--model` loaded here (LocalTeacher).
    Returns it, the model's name, its quantization ("" when not reported) and architecture."""
    kinds = cfg.outputs()
    if cfg.teacher:
        from student_trainer.client import TeacherClient

        client = TeacherClient(
            cfg.teacher, device, outputs=kinds, dtype=cfg.dtype or None, tokenizer=tokenizer,
            max_inflight=cfg.prefetch + 1, job_id=cfg.job_id or f"dump-{Path(cfg.teacher_outputs).name}",
            transfer_timeout_s=cfg.teacher_timeout_s, reconnect_timeout_s=cfg.teacher_reconnect_timeout_s,
            weight=cfg.teacher_weight, tls_ca=cfg.teacher_tls, tls_cert=cfg.teacher_tls_cert or None,
            tls_key=cfg.teacher_tls_key or None)
        return client, client.info.model_name, "", client.info.architecture
    from distill_common.models import load_causal_lm
    from distill_common.vocab import tokenizer_fingerprint
    from student_trainer.local_teacher import LocalTeacher

    model = load_causal_lm(cfg.model, device=device, dtype=wire.parse_output_dtype(cfg.model_dtype)
                           if cfg.model_dtype else None)
    local = LocalTeacher(model, kinds, wire.parse_output_dtype(cfg.dtype) if cfg.dtype else None)
    # A local teacher's facts lack the tokenizer's fingerprint (a server reports it): the store records it.
    facts = local.outputs.teacher
    local.outputs = OutputRequest(local.outputs.kinds, local.outputs.dtype, TeacherFacts(
        **{**facts.__dict__, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}))
    quantization = getattr(model.config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    return local, cfg.model, str(method or "none"), type(model).__name__

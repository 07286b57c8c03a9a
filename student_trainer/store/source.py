"""The trainer's third source of teacher outputs, beside TeacherClient and LocalTeacher: a store,
read off the training thread, filled through by a teacher given as well."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from distill_common import store as fmt
from distill_common import wire
from distill_common.outputs import (FinalHidden, JoinData, Output, OutputHead, OutputRequest, SubsetLogits,
                                    TeacherOutput, output_spec)
from distill_common.store import StoreError, StoreMismatch, StoreMissing
from student_trainer.store.directory import TeacherStore, data_facts, teacher_facts
from student_trainer.store.writer import ShardWriter


# Batches read at once by a StoreTeacher without a teacher: enough reads in flight for an NVMe disk and
# several batches' rows hashed at once (reads and sha256 release the GIL), few enough threads for a
# trainer's host.
READ_WORKERS = 4


class StoreTeacher:
    """Teacher outputs read from a store, with TeacherClient's interface (see the module's docstring)."""

    def __init__(self, store: TeacherStore, device: str | torch.device, asked: OutputRequest, *,
                 teacher=None, model_name: str = "", rows_per_shard: int = 256, record_reads: bool = False,
                 timeout_s: float = 900.0, read_workers: int = READ_WORKERS):
        """`asked`: the outputs the run reads (resolved against the store's teacher). `teacher`: a
        TeacherClient or LocalTeacher asked for what the store lacks, which is written through.
        `record_reads`: keep where every row read lay (`read_locations`, for tests). `timeout_s`: the
        longest wait for the teacher's outputs of one batch to write through. `read_workers`: batches
        read at once (each its rows read and hashed); one with a teacher, whose
        batches must be read in order (a row written through by one is read back by a later one)."""
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
        # What TeacherClient holds for a student with another tokenizer: never, since such outputs are
        # shaped by text sent with each batch and a store refuses them.
        self.matched_student_ids = None
        if teacher is not None:
            store.check_teacher(teacher.outputs, model_name)
        self.writer = ShardWriter(store, rows_per_shard) if teacher is not None else None
        if read_workers < 1:
            raise ValueError(f"read_workers must be at least 1, got {read_workers}")
        self._reader = ThreadPoolExecutor(max_workers=1 if teacher is not None else read_workers,
                                          thread_name_prefix="store-read")
        self._record_lock = threading.Lock()
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
            raise StoreMismatch(f"{self.store.directory / fmt.MANIFEST} holds rows of {self.store.seq_len} tokens, "
                                f"this batch has {input_ids.shape[1]}: train with the --seq-len it was dumped with")
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
            tokens = mask[missing].sum(1).tolist()
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
        with self._record_lock:
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
                       timeout_s: float = 900.0, read_workers: int = READ_WORKERS) -> StoreTeacher:
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
                        record_reads=record_reads, timeout_s=timeout_s, read_workers=read_workers)

"""Teacher outputs computed once: a store on disk that the trainer reads like a live teacher.

    student-trainer dump --teacher HOST:PORT --tokenizer DIR --data train.jsonl --topk 64 \\
        --teacher-outputs store/                       # or --model DIR: the teacher in this process
    student-trainer train --teacher-outputs store/ --topk 64 --model ... --data train.jsonl

The format (safetensors shards, a JSON manifest, ids packed to the vocabulary's bits) is
distill_common/store.py's. Here, a module each:

- `directory.TeacherStore`: one store directory: its manifest checked against what a run asks (the data,
  the packing, the outputs, the teacher), and shards written (under a temporary name, synced,
  renamed, then named in the manifest).
- `files.ShardFiles`: the files its manifest names (the shards, the head), each opened and checked
  against the manifest, the index from a row's key to where it lies, and rows read with
  `os.preadv` into (pinned) batch buffers (each row hashed there and checked against its
  digest, the shard's `row_sha256`).
- `writer.ShardWriter`: rows written into shards by a thread of its own (a dump's batch by batch
  as they reach the host), so that a dump's forwards never wait for a write.
- `timing.StageTimes`: where reads and writes spend their time (the bench's `--profile`).
- `source.StoreTeacher`: the trainer's third source of teacher outputs, beside `TeacherClient` and
  `LocalTeacher`, with their interface (`submit` -> a future of a `TeacherOutput`, `info`,
  `joined`, `outputs`, `close`): rows are read by a thread of its own, off the training
  thread, several batches at once. Rows are found by their key (the digest of their ids and mask), so whatever batches
  a rank draws (its share under DDP, after an exact `--resume`, the HF Trainer's) it reads
  them. With a teacher as well (`--teacher-outputs` and `--teacher`), a batch with rows the
  store lacks is asked of the teacher and its missing rows are written through.
- `dump.dump`: `student-trainer dump`: the trainer's own data pipeline (student_trainer/data.py),
  rows in order, batch by batch, from a served teacher or one loaded in this process; killed
  and started again it continues after the last complete shard and writes the same bytes.
"""

from distill_common.store import StoreCorrupt, StoreError, StoreMismatch, StoreMissing
from student_trainer.store.directory import TeacherStore, data_facts, teacher_facts
from student_trainer.store.dump import DumpResult, dump, dump_rows
from student_trainer.store.source import StoreTeacher, open_store_teacher
from student_trainer.store.writer import ShardWriter

__all__ = ["TeacherStore", "ShardWriter", "StoreTeacher", "StoreError", "StoreCorrupt", "StoreMismatch",
           "StoreMissing", "open_store_teacher", "dump", "dump_rows", "DumpResult", "data_facts", "teacher_facts"]

"""The store of teacher outputs (student_trainer/store/): what it costs on disk, to write and to read.

    python3 -m bench.store_throughput --out store.md     # one GPU: a Llama-3-8B-shaped teacher, bf16
    python3 -m bench.store_throughput --tiny             # the CPU check: every code path, tiny sizes
    python3 -m bench.store_throughput --device cpu --shape mid --profile   # where the time goes, on a CPU

Three tables, from one run:

1. Bytes per token of every stored kind, at the Llama-3-8B shape (vocabulary 128,256, bf16,
   4,096-token rows) and the demo's (`make demo`'s teacher, float32, 128-token rows): the
   shards' tensors as the format lays them out (ids packed to the vocabulary's bits) plus the
   32-byte row key and 32-byte row digest, without zstd (what it saves depends on the model:
   random weights say nothing).
2. Dump throughput: tokens/s of `dump_rows` (the dump's own loop: the teacher's forward in this
   process, top-k and id packing on the device, the shard writer's thread copying and writing)
   against the same teacher's forward alone (`ModelRunner.forward`, what the kind needs of it),
   for top-64 and for the final hidden state, 16 batches by default; the forward is warmed up
   and a two-batch dump into a scratch store comes first, so neither the kernels' first load nor
   the pinned buffers' first allocation is timed. The dump's time ends when its last shard is
   synced and named in the manifest. Also the teacher alone with its outputs (`LocalTeacher`:
   forward + top-k): what the dump costs beyond the device's own work. Goal: >= 90%.
3. Read throughput of one trainer process: tokens/s of a `StoreTeacher` reading the dumped rows
   in a shuffled order onto the trainer's device, two batches ahead as the trainer's prefetcher
   asks them, after each shard was dropped from the page cache (posix_fadvise DONTNEED), so
   the rows come from the disk; each row read is hashed and checked against its digest
   (`row_sha256`), no shard is read whole. Goal: >= 10x the student's 35.4k tokens/s of the 1.5B pipeline
   bench (docs/performance.md), so reading never limits training.

`--profile` adds a fourth table: where the dump's and the reads' time goes (StageTimes: seconds
per batch of each stage, summed over the threads that spend it, and the most threads in it at once),
and the rows' bytes a batch read and hashed (equal: each byte read is hashed once).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.distill_pipeline import TEACHER_SHAPE, VOCAB
from bench.table import emit
from distill_common import store as fmt
from distill_common.outputs import (Argmax, AttentionFacts, AttentionInputs, AuxHiddenStates, FinalHidden,
                                    ForwardNeeds, HeadFacts, HiddenStates, Logits, NextTokenLogprobs, OutputRequest,
                                    TeacherFacts, TopK, default_aux_layers)

SHAPES = {
    "llama3-8b": dict(vocab_size=VOCAB, max_position_embeddings=8192, **TEACHER_SHAPE),
    # make demo's teacher (distill_demo/config.py: TEACHER, its 1024-token BPE vocabulary).
    "demo": dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, max_position_embeddings=512),
    # A CPU-sized teacher whose final hidden state is 8 KB a token, as the 8B's: the store's costs show.
    "mid": dict(vocab_size=8192, hidden_size=2048, intermediate_size=512, num_hidden_layers=1, num_attention_heads=16,
                num_key_value_heads=4, max_position_embeddings=1024),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512),
}
DTYPES = {"llama3-8b": torch.bfloat16, "demo": torch.float32, "mid": torch.float32, "tiny": torch.float32}
SEQ = {"llama3-8b": 4096, "demo": 128, "mid": 512, "tiny": 32}
STUDENT_TOKENS_PER_S = 35_400  # the 1.5B student's step in the pipeline bench (docs/performance.md)


def facts_of(shape: str) -> TeacherFacts:
    config = SHAPES[shape]
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    return TeacherFacts(vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=config["num_hidden_layers"],
                        dtype=DTYPES[shape], head=HeadFacts(unavailable=""),
                        attention=AttentionFacts(hidden, kv_heads * head_dim, kv_heads * head_dim, unavailable=""))


def stored_kinds(facts: TeacherFacts) -> list[tuple[str, tuple, bool]]:
    """(name, kinds, ids packed) of every stored kind the table lists."""
    last = facts.num_layers
    return [("logits", (Logits(),), True),
            ("top-64", (TopK(64),), True),
            ("top-64, int32 ids", (TopK(64),), False),
            ("top-128", (TopK(128),), True),
            ("final hidden state (+ head once)", (FinalHidden(),), True),
            ("hidden states, 1 layer", (HiddenStates((last // 2,)),), True),
            ("attention inputs, 1 layer", (AttentionInputs((last // 2,)),), True),
            ("next-token log-probabilities", (NextTokenLogprobs(),), True),
            ("EAGLE-3 inputs (aux x3, argmax, final hidden)",
             (FinalHidden(), AuxHiddenStates(default_aux_layers(last) if last >= 7 else (0, 1, last)), Argmax()),
             True)]


def bytes_per_token(shape: str) -> list[dict]:
    facts, seq = facts_of(shape), SEQ[shape]
    rows = []
    for name, kinds, packed in stored_kinds(facts):
        request = OutputRequest(tuple(kinds), facts.dtype, facts)
        # + the row key and the row digest, 32 bytes each
        per_row = sum(codec.row_bytes for codec in fmt.codecs_for(request, seq, pack=packed)) + 64
        head = facts.vocab_size * facts.hidden_size * facts.dtype.itemsize if FinalHidden() in kinds else 0
        rows.append({"shape": shape, "kind": name, "bytes_per_token": per_row / seq, "once_bytes": head})
    return rows


def build_teacher(shape: str, device: torch.device):
    """Random weights in the shape's dtype, built where they run (an 8B model never touches the host)."""
    from transformers import LlamaConfig

    from bench.models import random_model

    return random_model(LlamaConfig(**SHAPES[shape]), device, DTYPES[shape])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drop_from_page_cache(directory: Path) -> None:
    for path in directory.glob("shard-*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_kind(model, kinds: tuple, ids: torch.Tensor, mask: torch.Tensor, rows: int, device: torch.device,
                 directory: Path, read_workers: int, profile: bool) -> dict:
    from student_trainer.local_teacher import LocalTeacher
    from student_trainer.store import StoreTeacher, TeacherStore, data_facts, dump_rows, teacher_facts
    from student_trainer.store.timing import StageTimes

    teacher = LocalTeacher(model, kinds)
    needs: ForwardNeeds = teacher.outputs.needs
    batches = [(ids[i:i + rows], mask[i:i + rows]) for i in range(0, len(ids), rows)]
    tokens = int(mask.sum())
    teacher.runner.forward(*batches[0], needs)  # warm-up: kernels loaded, allocator grown
    synchronize(device)

    start = time.perf_counter()
    for batch_ids, batch_mask in batches:
        forward = teacher.runner.forward(batch_ids, batch_mask, needs)
        del forward
    synchronize(device)
    alone_s = time.perf_counter() - start

    start = time.perf_counter()
    for batch_ids, batch_mask in batches:
        teacher.submit(batch_ids, batch_mask).result()
    synchronize(device)
    outputs_s = time.perf_counter() - start

    class _Data:  # what the manifest records of the data: random rows of one length
        fingerprint, mode, seq_len = "random", "pack", ids.shape[1]

        def __len__(self):
            return len(ids)

    def new_store(path: Path) -> TeacherStore:
        path.mkdir(parents=True)
        (path / "data").write_bytes(b"random rows")
        TeacherStore.create(path, teacher.outputs, teacher=teacher_facts(teacher, "random"),
                            data=data_facts(_Data(), path / "data"), head=teacher.joined)
        return TeacherStore(path)

    # Warm-up: the writer's first pinned buffers allocated, its code paths run once.
    scratch = directory.with_name(directory.name + "-warm-up")
    dump_rows(teacher, new_store(scratch), ids[:2 * rows], mask[:2 * rows], batch_size=rows,
              rows_per_shard=rows, prefetch=0)
    shutil.rmtree(scratch)
    store = new_store(directory)
    dump_times = store.times = StageTimes() if profile else None
    start = time.perf_counter()
    dump_rows(teacher, store, ids, mask, batch_size=rows, rows_per_shard=4 * rows, prefetch=0)
    dump_s = time.perf_counter() - start
    disk_bytes = sum(entry["bytes"] for entry in fmt.read_manifest(directory)["shards"])

    drop_from_page_cache(directory)
    read_store = TeacherStore(directory)
    read_times = read_store.times = StageTimes() if profile else None
    reader = StoreTeacher(read_store, device, store.request, read_workers=read_workers)
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    futures = []
    for i in range(0, len(ids), rows):
        futures.append(reader.submit(ids[order[i:i + rows]], mask[order[i:i + rows]]))
        if len(futures) > 2:  # two ahead of the one "training", as the trainer's prefetcher
            futures.pop(0).result(timeout=600)
    for future in futures:
        future.result(timeout=600)
    synchronize(device)
    read_s = time.perf_counter() - start
    reader.close()
    result = {"tokens": tokens, "alone_tokens_per_s": tokens / alone_s, "outputs_tokens_per_s": tokens / outputs_s,
              "dump_tokens_per_s": tokens / dump_s, "dump_share": alone_s / dump_s,
              "disk_bytes_per_token": disk_bytes / tokens, "read_tokens_per_s": tokens / read_s}
    if profile:
        result["profile"] = {"batches": len(batches), "dump_s": dump_s, "read_s": read_s,
                             "dump": _stages(dump_times), "read": _stages(read_times),
                             "row_bytes_read": read_store.row_bytes_read,
                             "row_bytes_hashed": read_store.row_bytes_hashed}
    return result


def _stages(times) -> dict:
    return {name: {"seconds": seconds, "count": times.counts[name], "max_in_flight": times.max_in_flight.get(name, 0)}
            for name, seconds in times.seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the CPU check: a tiny teacher, a few rows")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=2, help="rows per teacher batch")
    parser.add_argument("--batches", type=int, default=16, help="batches dumped and read per kind")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="",
                        help="the teacher's shape (default: llama3-8b, tiny with --tiny); mid: a CPU-sized one")
    parser.add_argument("--read-workers", type=int, default=0, help="the reader's threads (default: StoreTeacher's)")
    parser.add_argument("--profile", action="store_true", help="also where the dump's and the reads' time goes")
    parser.add_argument("--dir", default="", help="where the stores are written (default: a temporary directory)")
    parser.add_argument("--out", default="", help="also write the table here (and the figures as .json)")
    args = parser.parse_args(argv)
    shape = args.shape or ("tiny" if args.tiny else "llama3-8b")
    from student_trainer.store.source import READ_WORKERS

    read_workers = args.read_workers or READ_WORKERS
    device = torch.device(args.device)
    if device.type == "cuda":  # "cuda" alone is the current device: name its index
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)

    sizes = bytes_per_token("llama3-8b") + bytes_per_token("demo") + (bytes_per_token(shape) if shape not in
                                                                       ("llama3-8b", "demo") else [])
    lines = ["Bytes per token, as stored (ids packed to the vocabulary's bits, no zstd; + the 32-byte row key and "
             "row digest)", "",
             "| shape | stored | bytes / token | once |", "|---|---|---:|---:|"]
    for row in sizes:
        once = f"{row['once_bytes'] / 2**20:.1f} MiB" if row["once_bytes"] else ""
        lines.append(f"| {row['shape']} ({SEQ[row['shape']]}-token rows) | {row['kind']} | "
                     f"{row['bytes_per_token']:,.1f} | {once} |")

    root = Path(args.dir or tempfile.mkdtemp(prefix="store-bench-"))
    model = build_teacher(shape, device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (args.rows * args.batches, SEQ[shape]), generator=generator)
    mask = torch.ones_like(ids)
    measured = []
    try:
        for name, kinds in (("top-64", (TopK(64),)), ("final hidden state", (FinalHidden(),))):
            result = measure_kind(model, kinds, ids, mask, args.rows, device, root / name.replace(" ", "-"),
                                  read_workers, args.profile)
            measured.append({"shape": shape, "kind": name, **result})
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines += ["", f"Dump and read, {shape} ({DTYPES[shape]}, {args.rows} x {SEQ[shape]} tokens a batch, "
              f"{args.batches} batches; reads by {read_workers} threads) on {where}", "",
              "| stored | forward alone tok/s | forward + outputs tok/s | dump tok/s | dump / forward | "
              "on disk B/token | read tok/s | read / student |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in measured:
        lines.append(f"| {row['kind']} | {row['alone_tokens_per_s']:,.0f} | {row['outputs_tokens_per_s']:,.0f} | "
                     f"{row['dump_tokens_per_s']:,.0f} | {row['dump_share']:.1%} | {row['disk_bytes_per_token']:,.1f} | "
                     f"{row['read_tokens_per_s']:,.0f} | {row['read_tokens_per_s'] / STUDENT_TOKENS_PER_S:.1f}x |")
    if args.profile:
        lines += ["", "Where the time goes (ms per batch, summed over the threads that spend it; the most threads "
                  "in a stage at once)", "", "| stored | path | stage | ms / batch | most at once |",
                  "|---|---|---|---:|---:|"]
        for row in measured:
            profile = row["profile"]
            for path in ("dump", "read"):
                lines.append(f"| {row['kind']} | {path} | the whole {path} (wall) | "
                             f"{1000 * profile[path + '_s'] / profile['batches']:,.1f} | |")
                for name, figures in profile[path].items():
                    lines.append(f"| {row['kind']} | {path} | {name} | "
                                 f"{1000 * figures['seconds'] / profile['batches']:,.1f} | {figures['max_in_flight']} |")
        lines += ["", "| stored | rows' MiB read / batch | rows' MiB hashed / batch |", "|---|---:|---:|"]
        for row in measured:
            profile = row["profile"]
            lines.append(f"| {row['kind']} | {profile['row_bytes_read'] / 2**20 / profile['batches']:,.2f} | "
                         f"{profile['row_bytes_hashed'] / 2**20 / profile['batches']:,.2f} |")
    emit(lines, args.out, {"bytes_per_token": sizes, "measured": measured})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The store of teacher outputs (student_trainer/store/, distill_common/store.py) on CPU: a real
tiny teacher (LocalTeacher), the trainer's own data pipeline, real files; one `student-trainer
dump` in a child process killed with SIGKILL. Training from a store against a served teacher is
in tests/test_trainer.py."""

from __future__ import annotations

import contextlib
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from distill_common import store as fmt
from distill_common.outputs import (Argmax, AttentionInputs, AuxHiddenStates, FinalHidden, HiddenStates, Logits,
                                    NextTokenLogprobs, OutputRequest, SubsetLogits, TopK)
from student_trainer.config import DumpConfig
from student_trainer.data import BatchIterator, PackedDataset
from student_trainer.store import (StoreCorrupt, StoreError, StoreMismatch, StoreMissing, StoreTeacher, TeacherStore,
                                   dump, open_store_teacher)
from tests.helpers import ROOT, build_tiny_model

VOCAB = 300
SEQ = 24
BATCH = 4
ALL_KINDS = (Logits(), TopK(8), HiddenStates((0, 2)), FinalHidden(), AttentionInputs((1,)),
             AuxHiddenStates((0, 1, 2)), Argmax(), NextTokenLogprobs())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from distill_demo.corpus import write_jsonl_corpus
    from distill_demo.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("store")
    corpus, _ = write_jsonl_corpus(root / "corpus", max_files=1, seq_chars=600)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    teacher = build_tiny_model(root / "teacher", vocab_size=VOCAB, layers=2)
    tokenizer.save_pretrained(teacher)
    # A few hundred tokens, some 14 rows: DDP steps of 2 x 4 with rows left over.
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"text": text[:160]}) + "\n" for text in texts[:3]))
    dataset = PackedDataset(train, tokenizer, SEQ)
    assert 12 <= len(dataset) <= 24 and len(dataset) % (2 * BATCH), len(dataset)
    return {"root": root, "data": train, "tokenizer": tokenizer, "teacher": teacher, "dataset": dataset}


def local_teacher(setup, kinds, dtype=None):
    from distill_common.models import load_causal_lm
    from student_trainer.local_teacher import LocalTeacher

    model = load_causal_lm(str(setup["teacher"]), device=torch.device("cpu"))
    return LocalTeacher(model, kinds, dtype)


def dump_config(setup, directory: Path, **changes) -> DumpConfig:
    options = dict(data=str(setup["data"]), teacher_outputs=str(directory), model=str(setup["teacher"]),
                   seq_len=SEQ, batch_size=BATCH, rows_per_shard=2 * BATCH, topk=8, device="cpu")
    return DumpConfig(**{**options, **changes})


def batches(dataset, rows_per_batch=BATCH, seed=1):
    it = BatchIterator(dataset, rows_per_batch, seed=seed, num_epochs=1)
    return list(it)


# ---- the format's parts ------------------------------------------------------------------------


@pytest.mark.parametrize("bits,count", [(17, 64 * 3), (9, 7), (1, 5)])
def test_ids_pack_to_the_vocabularys_bits_as_the_docs_read_them(bits, count):
    generator = torch.Generator().manual_seed(bits)
    ids = torch.randint(0, 1 << bits, (3, count), generator=generator)
    packed = fmt.pack_ids(ids, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, -(-count * bits // 8))
    assert torch.equal(fmt.unpack_ids(packed, count, bits), ids.to(torch.int32))
    # The reader the docs give, with numpy alone.
    stream = np.unpackbits(packed.numpy(), axis=1, bitorder="little")[:, :count * bits].reshape(3, count, bits)
    assert np.array_equal((stream.astype(np.int64) << np.arange(bits)).sum(-1), ids.numpy())
    assert fmt.id_bits(128_256) == 17 and fmt.id_bits(VOCAB) == 9
    with pytest.raises(StoreError, match="cannot be packed to 9 bits"):
        fmt.pack_ids(torch.tensor([[512]]), 9)


# ---- every kind, written and read back ------------------------------------------------------------


def fill(store_dir: Path, setup, teacher, rows: list[dict], **create) -> None:
    """A store of `rows` (batches) written from `teacher`'s outputs, as write-through writes them."""
    from student_trainer.store import ShardWriter, data_facts, teacher_facts

    TeacherStore.create(store_dir, teacher.outputs, teacher=teacher_facts(teacher, "tiny"),
                        data=data_facts(setup["dataset"], setup["data"]), head=teacher.joined, **create)
    store = TeacherStore(store_dir)
    writer = ShardWriter(store, rows_per_shard=6)
    for batch in rows:
        out = teacher.submit(batch["input_ids"], batch["attention_mask"]).result()
        keys = [fmt.row_key(i, m) for i, m in zip(batch["input_ids"], batch["attention_mask"])]
        writer.add(keys, teacher.outputs.disassemble(out), batch["attention_mask"].sum(1).tolist())
    writer.close()


def check_as_the_docs_say(directory: Path) -> None:
    """Every shard of the store checked by the code distill_common/store.py's docstring gives for
    checking a shard without this project, run as it is written there."""
    text = fmt.__doc__.split("Checking a shard without this project", 1)[1].split("\n\n", 1)[1]
    code = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("    "):
            break
        code.append(line[4:])
    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        for entry in manifest["shards"]:
            exec("\n".join(code), {"entry": entry, "tensors": manifest["outputs"]["tensors"]})
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("variant", ["float32", "bfloat16 raw ids", "zstd"])
def test_every_kind_round_trips(setup, tmp_path, variant):
    create, dtype = {}, None
    if variant == "bfloat16 raw ids":
        create, dtype = {"pack_ids": False}, torch.bfloat16
    if variant == "zstd":
        pytest.importorskip("zstandard", reason="the store-zstd extra")
        create = {"zstd_level": 3}
    teacher = local_teacher(setup, ALL_KINDS, dtype)
    written = batches(setup["dataset"])[:3]
    fill(tmp_path / "s", setup, teacher, written, **create)

    # Read in another grouping than written: rows are found by their ids.
    rows = {key: torch.cat([b[key] for b in written]) for key in ("input_ids", "attention_mask")}
    order = torch.randperm(len(rows["input_ids"]), generator=torch.Generator().manual_seed(0))[:5]
    with open_store_teacher(tmp_path / "s", "cpu", ALL_KINDS, dtype=dtype and "bfloat16",
                            dataset=setup["dataset"], data_path=setup["data"]) as source:
        got = source.submit(rows["input_ids"][order], rows["attention_mask"][order]).result(timeout=30)
        head = source.joined.head
    live = teacher.submit(rows["input_ids"][order], rows["attention_mask"][order]).result()
    assert got.logits.dtype == live.logits.dtype == (dtype or torch.float32)
    for name in ("logits", "topk_values", "topk_indices", "final_hidden", "aux_hidden_states", "argmax",
                 "next_token_logprobs"):
        assert torch.equal(getattr(got, name), getattr(live, name)), name
    assert got.hidden_states.keys() == live.hidden_states.keys() == {0, 2}
    for layer in (0, 2):
        assert torch.equal(got.hidden_states[layer], live.hidden_states[layer])
    for a, b in zip(got.attention_inputs[1], live.attention_inputs[1]):
        assert torch.equal(a, b)
    assert torch.equal(head.weight, teacher.joined.head.weight)  # the head, stored once
    check_as_the_docs_say(tmp_path / "s")


def test_subset_logits_come_from_the_final_hidden_state_and_the_heads_rows(setup, tmp_path):
    """What `student-trainer eagle3` reads of a store dumped with --eagle3."""
    kinds = (FinalHidden(), AuxHiddenStates((0, 1, 2)), Argmax())
    teacher = local_teacher(setup, kinds)
    written = batches(setup["dataset"])[:1]
    fill(tmp_path / "s", setup, teacher, written)
    subset = SubsetLogits((5, 0, 77, 299))
    asked = (subset, AuxHiddenStates((0, 1, 2)), Argmax())
    with open_store_teacher(tmp_path / "s", "cpu", asked) as source:
        got = source.submit(written[0]["input_ids"], written[0]["attention_mask"]).result(timeout=30)
    live = local_teacher(setup, asked).submit(written[0]["input_ids"], written[0]["attention_mask"]).result()
    torch.testing.assert_close(got.subset_logits, live.subset_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.aux_hidden_states, live.aux_hidden_states) and torch.equal(got.argmax, live.argmax)


# ---- dump: SIGKILL, resume, the same bytes ----------------------------------------------------------


def shard_bytes(directory: Path) -> dict[str, bytes]:
    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    return {entry["file"]: (directory / entry["file"]).read_bytes() for entry in manifest["shards"]}


TWO_ROW_SHARDS = dict(batch_size=2, rows_per_shard=2)


@pytest.fixture(scope="module")
def reference_dump(setup) -> Path:
    """An uninterrupted dump of two-row shards."""
    directory = setup["root"] / "reference"
    complete = dump(dump_config(setup, directory, **TWO_ROW_SHARDS))
    assert complete.rows == len(setup["dataset"]) and complete.shards_written == -(-len(setup["dataset"]) // 2)
    return directory


def test_a_dump_stopped_mid_way_continues_to_the_same_bytes(setup, reference_dump, tmp_path):
    """What a dump killed at any moment leaves (the manifest is replaced atomically): a manifest naming
    the shards complete before the kill, maybe the next shard renamed but not yet named, maybe a
    temporary file. The next dump continues from there to the same bytes."""
    import shutil

    stopped = Path(shutil.copytree(reference_dump, tmp_path / "stopped"))
    manifest = json.loads((stopped / fmt.MANIFEST).read_text())
    kept = 3
    for entry in manifest["shards"][kept + 1:]:
        (stopped / entry["file"]).unlink()
    (stopped / manifest["shards"][kept]["file"]).write_bytes(b"half a shard")  # renamed, not yet named
    manifest["shards"] = manifest["shards"][:kept]
    fmt.write_manifest(stopped, manifest)
    # The temporary files of the stopped dump (a process no longer running) go; what is not one of
    # them stays: a link of such a name, another running process's, a name no writer makes.
    stopped_pid = subprocess.Popen(["true"])
    stopped_pid.wait()
    stale = [f".shard-{stopped_pid.pid}-9f3a.tmp", f".manifest.json.tmp-{stopped_pid.pid}"]
    kept_files = [f".shard-{os.getppid()}-77.tmp", ".shard-notes.tmp", f".shard-{stopped_pid.pid}-aa.tmp"]
    for name in [*stale, *kept_files[:2]]:
        (stopped / name).write_bytes(b"half")
    (tmp_path / "elsewhere").write_bytes(b"not the store's")
    (stopped / kept_files[2]).symlink_to(tmp_path / "elsewhere")

    resumed = dump(dump_config(setup, stopped, **TWO_ROW_SHARDS))
    assert resumed.resumed_at_row == 2 * kept and resumed.rows_written == len(setup["dataset"]) - 2 * kept
    assert shard_bytes(stopped) == shard_bytes(reference_dump)
    assert (stopped / fmt.MANIFEST).read_bytes() == (reference_dump / fmt.MANIFEST).read_bytes()
    assert not any((stopped / name).exists() for name in stale)
    assert all((stopped / name).is_symlink() or (stopped / name).exists() for name in kept_files)
    assert (tmp_path / "elsewhere").read_bytes() == b"not the store's"
    with pytest.raises(StoreMismatch, match=r"was dumped with .*rows_per_shard.*continue it with the same settings"):
        dump(dump_config(setup, stopped, batch_size=2, rows_per_shard=4))


@pytest.mark.slow
def test_a_dump_killed_with_sigkill_continues_to_the_same_bytes(setup, tmp_path):
    """The same with a real `student-trainer dump` process killed with SIGKILL while it writes."""
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    one_row_shards = dict(batch_size=1, rows_per_shard=1)  # many shards: the kill lands mid-dump
    dump(dump_config(setup, reference, **one_row_shards))

    command = [sys.executable, "-m", "student_trainer", "dump", "--model", str(setup["teacher"]), "--data",
               str(setup["data"]), "--teacher-outputs", str(killed), "--seq-len", str(SEQ), "--topk", "8",
               "--batch-size", "1", "--rows-per-shard", "1", "--device", "cpu"]
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not (killed / fmt.MANIFEST).exists() or not json.loads((killed / fmt.MANIFEST).read_text())["shards"]:
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the dump wrote no shard within 120 s"
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    kept = json.loads((killed / fmt.MANIFEST).read_text())["shards"]
    assert 0 < len(kept) < len(setup["dataset"]), "the kill came after the dump ended: nothing was tested"
    # A shard renamed when the kill came, before the manifest named it, and a half-written temporary
    # file: neither is part of the store, and the dump started again replaces them.
    (killed / f"shard-{len(kept):06d}.safetensors").write_bytes(b"half a shard")
    (killed / f".shard-{len(kept) + 1:06d}.safetensors.tmp-1").write_bytes(b"half")

    resumed = dump(dump_config(setup, killed, **one_row_shards))
    assert resumed.resumed_at_row == sum(entry["rows"] for entry in kept)
    assert shard_bytes(killed) == shard_bytes(reference)
    assert (killed / fmt.MANIFEST).read_bytes() == (reference / fmt.MANIFEST).read_bytes()


# ---- refusals -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dumped(setup) -> Path:
    directory = setup["root"] / "dumped"
    dump(dump_config(setup, directory))
    return directory


@pytest.fixture
def small_store(dumped, tmp_path) -> Path:
    """A copy of a dumped store, for a test to change."""
    import shutil

    return Path(shutil.copytree(dumped, tmp_path / "store"))


def read_all(directory: Path, setup, **options):
    with open_store_teacher(directory, "cpu", (TopK(8),), dataset=setup["dataset"], data_path=setup["data"],
                            **options) as source:
        for batch in batches(setup["dataset"]):
            source.submit(batch["input_ids"], batch["attention_mask"]).result(timeout=30)


def read_rows(directory: Path, setup, rows: list[int]):
    """Rows `rows` of the dataset as one batch, read from the store at `directory` (as a trainer reads them)."""
    ids, mask = setup["dataset"].input_ids[rows], setup["dataset"].attention_mask[rows]
    with open_store_teacher(directory, "cpu", (TopK(8),)) as source:
        return source.submit(ids, mask).result(timeout=30)


def layout_of(shard: Path) -> tuple[dict, bytes]:
    fd = os.open(shard, os.O_RDONLY)
    try:
        return fmt.read_layout(fd, shard, shard.stat().st_size)
    finally:
        os.close(fd)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_row_is_refused_when_that_row_is_read(setup, dumped, small_store):
    """A dump's first shard holds the data's rows 0-7 in order. A byte flipped in row 5's values and
    one in row 7's packed ids (its last byte: bits past the row's ids, which no decoder reads) are
    each refused when their row is read, naming the file and the row; the shard's other rows read
    as before."""
    shard = small_store / "shard-000000.safetensors"
    places, _ = layout_of(shard)
    values, ids = places["TopK.0"], places["TopK.1"]
    assert values.shape[0] == ids.shape[0] == 2 * BATCH
    flip(shard, values.begin + 5 * (values.end - values.begin) // values.shape[0] + 7)
    flip(shard, ids.end - 1)
    for row in (5, 7):
        with pytest.raises(StoreCorrupt, match=rf"shard-000000\.safetensors: row {row} differs from its digest "
                                               r"\(row_sha256\): the file changed after it was written"):
            read_rows(small_store, setup, [2, row])
    intact = [0, 1, 2, 3, 4, 6]
    got, reference = read_rows(small_store, setup, intact), read_rows(dumped, setup, intact)
    assert torch.equal(got.topk_values, reference.topk_values) and torch.equal(got.topk_indices, reference.topk_indices)


def test_a_shards_tampered_digests_or_header_are_refused_when_it_is_opened(setup, small_store):
    shard = small_store / "shard-000001.safetensors"
    places, header = layout_of(shard)
    flip(shard, places[fmt.ROW_SHA256].begin + 40)  # row 1's digest
    with pytest.raises(StoreCorrupt, match=r"shard-000001\.safetensors: the sha256 of its row digests \(row_sha256\) "
                                           r"is not the one .*manifest\.json records"):
        TeacherStore(small_store)
    flip(shard, places[fmt.ROW_SHA256].begin + 40)
    TeacherStore(small_store)  # as written again
    flip(shard, header.index(b"teacher-outputs"))  # the metadata: the header parses, the same tensors
    with pytest.raises(StoreCorrupt, match=r"shard-000001\.safetensors: the sha256 of its header is not the one"):
        TeacherStore(small_store)
    # A store of the format before rows had digests is refused, saying to dump it again.
    manifest = json.loads((small_store / fmt.MANIFEST).read_text())
    fmt.write_manifest(small_store, {**manifest, "format": "teacher-outputs/1"})
    with pytest.raises(StoreCorrupt, match=r"manifest\.json: format 'teacher-outputs/1', this version reads "
                                           r"'teacher-outputs/2' .*: dump the store again into a new directory"):
        TeacherStore(small_store)


def test_a_batch_reads_its_rows_bytes_once_each_hashed_and_no_whole_shard(setup, small_store):
    """What a batch costs the disk: its rows' bytes, each hashed once; never a shard's other rows (the
    process's read bytes, /proc/self/io's rchar, as the kernel counts them)."""
    from safetensors.torch import load_file

    def rchar() -> int:
        return int(re.search(r"^rchar: (\d+)$", Path("/proc/self/io").read_text(), re.M).group(1))

    shards = json.loads((small_store / fmt.MANIFEST).read_text())["shards"]
    stored = {entry["file"]: load_file(small_store / entry["file"]) for entry in shards[:2]}
    rows = [1, 2, 9, 12]  # rows 1-2 of the first shard, 1 and 4 of the second
    expected = sum(stored[shards[row // (2 * BATCH)]["file"]][name][row % (2 * BATCH)].numpy().nbytes
                   for row in rows for name in ("TopK.0", "TopK.1"))
    ids, mask = setup["dataset"].input_ids, setup["dataset"].attention_mask
    with open_store_teacher(small_store, "cpu", (TopK(8),), read_workers=1) as source:
        source.submit(ids[[0]], mask[[0]]).result(timeout=30)  # the reader's thread started, its code run once
        store = source.store
        before, read_before, hashed_before = rchar(), store.row_bytes_read, store.row_bytes_hashed
        source.submit(ids[rows], mask[rows]).result(timeout=30)
        read = rchar() - before
    assert store.row_bytes_read - read_before == store.row_bytes_hashed - hashed_before == expected
    # Some hundred bytes of other reads at most (none here); a whole-shard check would read both shards.
    assert expected <= read < expected + 1024 < min(entry["bytes"] for entry in shards[:2])


def test_a_truncated_shard_is_refused_naming_it(setup, small_store):
    shard = small_store / "shard-000001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(StoreCorrupt, match=r"shard-000001\.safetensors has \d+ bytes, the manifest records \d+: the "
                                           r"file is truncated"):
        read_all(small_store, setup)


def test_a_store_for_other_data_settings_or_outputs_is_refused(setup, small_store, tmp_path):
    manifest = str(small_store / fmt.MANIFEST)
    other = tmp_path / "other.jsonl"
    records = [json.loads(line) for line in setup["data"].read_text().splitlines()]
    other.write_text("".join(json.dumps({"text": r["text"].replace("e", "a")}) + "\n" for r in records))
    other_data = PackedDataset(other, setup["tokenizer"], SEQ)
    with pytest.raises(StoreMismatch, match=rf"{manifest} was dumped from other data: the data file: .*sha256"):
        open_store_teacher(small_store, "cpu", (TopK(8),), dataset=other_data, data_path=other)
    longer = PackedDataset(setup["data"], setup["tokenizer"], 2 * SEQ)
    with pytest.raises(StoreMismatch, match=rf"--seq-len {SEQ} there, {2 * SEQ} here"):
        open_store_teacher(small_store, "cpu", (TopK(8),), dataset=longer, data_path=setup["data"])
    with pytest.raises(StoreMismatch, match=rf"{manifest} holds topk=8\(T=1\) in float32: this run asks for logits, which "
                                            "it does not hold"):
        open_store_teacher(small_store, "cpu", (Logits(),), dataset=setup["dataset"], data_path=setup["data"])
    with pytest.raises(StoreMismatch, match="asks for them in bfloat16, it holds float32"):
        open_store_teacher(small_store, "cpu", (TopK(8),), dtype="bfloat16")
    # A batch the store lacks, with no teacher to ask: the run stops, saying so.
    with open_store_teacher(small_store, "cpu", (TopK(8),)) as source:
        ids = torch.zeros(2, SEQ, dtype=torch.int64)
        with pytest.raises(StoreMissing, match="lacks 2 of this batch's 2 rows"):
            source.submit(ids, torch.ones_like(ids)).result(timeout=30)
    with pytest.raises(StoreMissing, match="manifest.json does not exist: dump the teacher's outputs first"):
        open_store_teacher(tmp_path / "nothing", "cpu", (TopK(8),))


# ---- DDP and write-through ---------------------------------------------------------------------------


def test_ddp_ranks_read_disjoint_rows_that_cover_the_store(setup, small_store):
    dataset = setup["dataset"]
    read = []
    for rank in range(2):
        iterator = BatchIterator(dataset, BATCH, seed=5, rank=rank, world_size=2, num_epochs=1)
        with open_store_teacher(small_store, "cpu", (TopK(8),), dataset=dataset, data_path=setup["data"],
                                record_reads=True) as source:
            for batch in iterator:
                source.submit(batch["input_ids"], batch["attention_mask"]).result(timeout=30)
        read.append(source.read_locations)
    first, second = (set(locations) for locations in read)
    assert len(first) == len(read[0]) and len(second) == len(read[1]) and not first & second
    every = {(entry["file"], row) for entry in json.loads((small_store / fmt.MANIFEST).read_text())["shards"]
             for row in range(entry["rows"])}
    dropped = len(dataset) % (2 * BATCH)  # BatchIterator's remainder of the epoch, the same on both ranks
    assert first | second <= every and len(every - (first | second)) == dropped


class CountingTeacher:
    """A LocalTeacher that records the batches it is asked for."""

    def __init__(self, teacher):
        self.teacher, self.asked = teacher, []
        self.outputs, self.joined, self.address = teacher.outputs, teacher.joined, "local"

    def submit(self, input_ids, attention_mask=None, **kwargs):
        self.asked.append(input_ids.clone())
        return self.teacher.submit(input_ids, attention_mask, **kwargs)


def test_write_through_fills_exactly_the_missing_batches(setup, tmp_path):
    dataset, directory = setup["dataset"], tmp_path / "store"
    live = local_teacher(setup, (TopK(8),))
    epoch = batches(dataset, seed=2)
    first_half = epoch[: len(epoch) // 2]

    def run(rows, teacher=None):
        with open_store_teacher(directory, "cpu", (TopK(8),), dataset=dataset, data_path=setup["data"],
                                teacher=teacher, model_name="tiny", rows_per_shard=5, record_reads=True) as source:
            outs = [source.submit(b["input_ids"], b["attention_mask"]) for b in rows]
            outs = [future.result(timeout=30) for future in outs]
        return source, outs

    counting = CountingTeacher(live)
    # The store is created from the teacher and filled; the second time round the rows are read back
    # from the writer (fewer than a shard's rows: not yet written).
    source, outs = run(first_half + first_half, counting)
    assert len(counting.asked) == len(first_half) and source.rows_written_through == BATCH * len(first_half)
    for a, b in zip(outs, outs[len(first_half):]):
        assert torch.equal(a.topk_values, b.topk_values) and torch.equal(a.topk_indices, b.topk_indices)

    counting = CountingTeacher(live)
    source, outs = run(epoch, counting)  # a whole epoch: only the batches of the second half are missing
    assert [ids.tolist() for ids in counting.asked] == [b["input_ids"].tolist() for b in epoch[len(first_half):]]
    assert source.rows_written_through == BATCH * (len(epoch) - len(first_half))
    for batch, out in zip(epoch, outs):  # read or asked, the outputs are the teacher's
        ref = live.submit(batch["input_ids"], batch["attention_mask"]).result()
        assert torch.equal(out.topk_indices, ref.topk_indices) and torch.equal(out.topk_values, ref.topk_values)

    source, _ = run(epoch)  # and now without a teacher
    assert len(source.read_locations) == BATCH * len(epoch)
    with pytest.raises(StoreMismatch, match="made with another teacher or outputs"):
        run(epoch, CountingTeacher(local_teacher(setup, (TopK(4),))))


def test_an_eagle3_draft_trains_from_a_store_dumped_for_it(setup, tmp_path):
    """`dump --eagle3` stores the final hidden state (and the head), the aux layers and the argmax;
    `eagle3 --teacher-outputs` reads its draft vocabulary's logits from them."""
    import math

    from student_trainer.eagle3.config import Eagle3Config
    from student_trainer.eagle3.train import train_eagle3

    store = tmp_path / "store"
    dump(dump_config(setup, store, topk=0, eagle3=True, aux_layers=(0, 1, 2)))
    config = Eagle3Config(target_model=str(setup["teacher"]), data=str(setup["data"]), teacher_outputs=str(store),
                          output_dir=str(tmp_path / "run"), seq_len=SEQ, batch_size=2, max_steps=1, ttt_steps=2,
                          aux_layers=(0, 1, 2), draft_vocab_size=64, device="cpu", log_level="WARNING")
    result = train_eagle3(config)
    assert result["step"] == 1 and all(math.isfinite(record["loss"]) for record in result["history"])
    assert (tmp_path / "run" / "draft" / "config.json").exists()


def test_zstd_without_the_package_is_refused_by_its_flag(setup, tmp_path):
    from distill_common.settings import ConfigError

    try:
        import zstandard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"--zstd-level: zstd compression needs the zstandard package: pip "
                                              r"install 'teacher-service\[store-zstd\]'"):
            dump_config(setup, tmp_path / "s", zstd_level=3)
    else:
        assert dump_config(setup, tmp_path / "s", zstd_level=3).zstd_level == 3


def test_the_dump_command_says_what_to_change(setup, small_store, capsys, caplog):
    from student_trainer.__main__ import main

    common = ["dump", "--data", str(setup["data"]), "--seq-len", str(SEQ), "--device", "cpu", "--batch-size", "4",
              "--rows-per-shard", "8"]
    with pytest.raises(SystemExit):
        main([*common, "--teacher-outputs", str(small_store), "--topk", "8"])  # neither --teacher nor --model
    assert "give --teacher HOST:PORT (a served teacher) or --model (one loaded here)" in capsys.readouterr().err
    # Another k than the store holds: refused naming the manifest, exit status 1, no traceback.
    assert main([*common, "--teacher-outputs", str(small_store), "--model", str(setup["teacher"]), "--topk", "4"]) == 1
    assert re.search(r"StoreMismatch: .*manifest\.json was made with another teacher or outputs than the one given to "
                     r"fill it: outputs topk=8\(T=1\) in float32 there, topk=4\(T=1\) in float32 here", caplog.text), caplog.text


# ---- the fast paths against their references -------------------------------------------------------


def test_a_shard_written_in_parts_equals_safetensors_own_bytes(tmp_path):
    import hashlib

    from safetensors.torch import save

    generator = torch.Generator().manual_seed(3)
    frames = [bytes(range(n)) for n in (3, 0, 7, 1, 4)]  # rows of their own sizes, as zstd frames are
    tensors = {"TopK.0": torch.randn(5, 3, 4, generator=generator).to(torch.bfloat16),
               "TopK.1": torch.randint(0, 255, (5, 7), generator=generator, dtype=torch.uint8),
               "Hidden.0": torch.randn(5, 6, generator=generator),
               "Ids.0": torch.randint(-9, 9, (5, 2), generator=generator, dtype=torch.int32),
               "Frames.0": torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8),
               "Frames.offsets": torch.arange(6, dtype=torch.int64), "Empty.0": torch.zeros(0, 4),
               fmt.ROW_KEY: torch.randint(0, 255, (5, 32), generator=generator, dtype=torch.uint8)}
    row_tensors = ["TopK.0", "Frames.0", "TopK.1", "Hidden.0", "Ids.0"]  # a row's digest takes them in this order

    def row_bytes(name, row):
        return frames[row] if name == "Frames.0" else tensors[name][row].contiguous().view(torch.uint8).numpy().tobytes()

    row_sha256 = b"".join(hashlib.sha256(b"".join(row_bytes(name, row) for name in row_tensors)).digest()
                          for row in range(5))
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    shard = fmt.ShardFile(tmp_path, {**specs, fmt.ROW_SHA256: (torch.uint8, (5, 32))}, row_tensors=row_tensors)
    for begin, end in ((0, 2), (2, 5)):  # rows in two parts, the tensors' parts interleaved
        for name in row_tensors + ["Frames.offsets", "Empty.0", fmt.ROW_KEY]:
            if name == "Frames.0":
                part = b"".join(frames[begin:end])
                shard.put(name, torch.frombuffer(bytearray(part), dtype=torch.uint8) if part else
                          torch.empty(0, dtype=torch.uint8), [len(frame) for frame in frames[begin:end]])
            else:
                shard.put(name, tensors[name][begin:end] if tensors[name].dim() > 1 else
                          (tensors[name] if begin == 0 else tensors[name][:0]))
    recorded = shard.finish()
    written = shard.path.read_bytes()
    tensors[fmt.ROW_SHA256] = torch.frombuffer(bytearray(row_sha256), dtype=torch.uint8).reshape(5, 32)
    assert written == save(tensors, metadata={"format": fmt.FORMAT})
    fd = os.open(shard.path, os.O_RDONLY)
    try:
        places, header = fmt.read_layout(fd, shard.path, len(written))
    finally:
        os.close(fd)
    assert header == written[:8 + int.from_bytes(written[:8], "little")]
    assert recorded == {"bytes": len(written), "sha256": hashlib.sha256(written).hexdigest(),
                        "header_sha256": hashlib.sha256(header).hexdigest(),
                        "row_sha256_sha256": hashlib.sha256(row_sha256).hexdigest()}
    for name, tensor in tensors.items():
        place = places[name]
        assert (place.dtype, place.shape) == (tensor.dtype, tuple(tensor.shape))
        assert written[place.begin:place.end] == tensor.contiguous().view(torch.uint8).numpy().tobytes()

    # A row's tensors put out of the digest's order are refused, not hashed in another order.
    shard = fmt.ShardFile(tmp_path, {**specs, fmt.ROW_SHA256: (torch.uint8, (5, 32))}, row_tensors=row_tensors)
    with pytest.raises(StoreError, match="TopK.1: row 0 put before the tensors that come before it"):
        shard.put("TopK.1", tensors["TopK.1"])
    shard.abort()


def test_reads_by_several_threads_equal_the_shards_as_safetensors_reads_them(setup, small_store):
    from safetensors.torch import load_file

    store = TeacherStore(small_store)
    reference = {}  # row key -> [each codec's row as stored], from safetensors itself
    for entry in store.manifest["shards"]:
        tensors = load_file(small_store / entry["file"])
        for row, key in enumerate(tensors[fmt.ROW_KEY].numpy()):
            reference[key.tobytes()] = [tensors[codec.name][row:row + 1] for codec in store.codecs]
    every = batches(setup["dataset"], rows_per_batch=3, seed=7)
    with open_store_teacher(small_store, "cpu", (TopK(8),), read_workers=4) as source:
        futures = [source.submit(b["input_ids"], b["attention_mask"]) for b in every]  # all in flight at once
        for batch, future in zip(every, futures):
            out = future.result(timeout=30)
            keys = [fmt.row_key(i, m) for i, m in zip(batch["input_ids"], batch["attention_mask"])]
            expected = [codec.decode(torch.cat([reference[key][index] for key in keys]))
                        for index, codec in enumerate(store.codecs)]
            assert torch.equal(out.topk_values, expected[0]) and torch.equal(out.topk_indices, expected[1])


def test_a_shard_with_a_foreign_header_is_refused_naming_it(setup, small_store):
    """A header of other tensors, even with the manifest's digest of it made to match."""
    import hashlib

    shard = small_store / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    length = int.from_bytes(data[:8], "little")
    data[8:8 + length] = data[8:8 + length].replace(b'"U8"', b'"I8"', 1)  # the same length, another dtype
    shard.write_bytes(bytes(data))
    manifest = json.loads((small_store / fmt.MANIFEST).read_text())
    manifest["shards"][1]["header_sha256"] = hashlib.sha256(data[:8 + length]).hexdigest()
    fmt.write_manifest(small_store, manifest)
    with pytest.raises(StoreCorrupt, match=r"shard-000001\.safetensors: not a shard this store wrote"):
        read_all(small_store, setup)


def test_dump_rows_in_batches_that_straddle_shards_continue_to_the_same_bytes(setup, tmp_path):
    """`dump_rows` (the CLI keeps batches inside shards) gives shards of exactly rows_per_shard rows
    whatever the batch size; started again after its first shard it writes the same bytes."""
    from student_trainer.store import data_facts, dump_rows, teacher_facts

    teacher, dataset = local_teacher(setup, (TopK(8),)), setup["dataset"]

    def run(directory: Path, start_row: int) -> None:
        if start_row == 0:
            TeacherStore.create(directory, teacher.outputs, teacher=teacher_facts(teacher, "tiny"),
                                data=data_facts(dataset, setup["data"]))
        dump_rows(teacher, TeacherStore(directory), dataset.input_ids, dataset.attention_mask, batch_size=3,
                  rows_per_shard=4, start_row=start_row)

    run(tmp_path / "whole", 0)
    rows = [entry["rows"] for entry in json.loads((tmp_path / "whole" / fmt.MANIFEST).read_text())["shards"]]
    assert sum(rows) == len(dataset) and rows[:-1] == [4] * (len(rows) - 1) and 0 < rows[-1] <= 4
    import shutil

    stopped = Path(shutil.copytree(tmp_path / "whole", tmp_path / "stopped"))
    manifest = json.loads((stopped / fmt.MANIFEST).read_text())
    for entry in manifest["shards"][1:]:
        (stopped / entry["file"]).unlink()
    manifest["shards"] = manifest["shards"][:1]
    fmt.write_manifest(stopped, manifest)
    run(stopped, 4)  # the first run's second batch began at row 3
    assert shard_bytes(stopped) == shard_bytes(tmp_path / "whole")
    assert not list(stopped.glob(".shard-*")) and not list((tmp_path / "whole").glob(".shard-*"))


# ---- a store is input from whoever wrote the directory --------------------------------------------


@contextlib.contextmanager
def within(seconds: float):
    """Fails the block if it runs longer than `seconds` (SIGALRM interrupts an open() that blocks)."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds}s (blocked on a FIFO?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def name_in_manifest(directory: Path, field: str, name: str) -> None:
    """The manifest's `field` ("shards.1" or "head") made to name `name`."""
    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    entry = manifest["head"] if field == "head" else manifest["shards"][int(field.split(".")[1])]
    entry["file"] = name
    fmt.write_manifest(directory, manifest)


@pytest.fixture
def outside(tmp_path) -> dict[str, Path]:
    """Files outside the store: a secret of a telling size, a FIFO (opening it would block) and a path
    that does not exist."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret").write_bytes(b"s" * 12345)
    os.mkfifo(folder / "fifo")
    return {"secret": folder / "secret", "fifo": folder / "fifo", "absent": folder / "absent"}


OUTSIDE = (r"a path outside .* \(absolute, through '\.\.', or a link leading out of it\): a store reads only files "
           "inside")


@pytest.mark.parametrize("how", ["absolute", "through ..", "a link"])
def test_a_shard_outside_the_store_is_refused_and_nothing_outside_is_opened(setup, small_store, outside, how):
    """Whatever lies at the path outside (a secret, a FIFO, nothing), the refusal is the same and
    tells nothing of it; a FIFO outside, were it opened, would block."""
    messages = []
    for target in ("secret", "fifo", "absent"):
        if how == "absolute":
            name = str(outside[target])
        elif how == "through ..":
            name = os.path.relpath(outside[target], small_store)
        else:
            link = small_store / "shard-000001.safetensors"
            link.unlink(missing_ok=True)
            link.symlink_to(outside[target])
            name = link.name
        name_in_manifest(small_store, "shards.1", name)
        refused = rf"manifest\.json's shards\[1\]\.file is .*: {OUTSIDE}"
        with within(10), pytest.raises(StoreCorrupt, match=refused) as e:
            TeacherStore(small_store)
        messages.append(str(e.value).replace(target, "X"))
    assert messages[0] == messages[1] == messages[2] and "12345" not in messages[0], messages


def test_a_head_outside_the_store_or_not_a_regular_file_is_refused(setup, tmp_path, outside):
    """A head naming /dev/zero (which would hash for ever), a link to it, or a FIFO inside the store."""
    store = tmp_path / "s"
    fill(store, setup, local_teacher(setup, (FinalHidden(),)), batches(setup["dataset"])[:1])
    assert TeacherStore(store).head is not None
    for name in ("/dev/zero", "zero-link"):
        (store / "zero-link").unlink(missing_ok=True)
        (store / "zero-link").symlink_to("/dev/zero")
        name_in_manifest(store, "head", name)
        with within(10), pytest.raises(StoreCorrupt, match=rf"manifest\.json's head\.file is '{name}': {OUTSIDE}"):
            TeacherStore(store)
    os.mkfifo(store / "fifo")
    name_in_manifest(store, "head", "fifo")
    with within(10), pytest.raises(StoreCorrupt, match=r"manifest\.json's head\.file is 'fifo': not a regular file "
                                                       r"\(a FIFO, a device, a directory\)"):
        TeacherStore(store)


def test_a_shard_that_is_a_fifo_or_a_directory_inside_the_store_is_refused(setup, small_store):
    os.mkfifo(small_store / "fifo")
    (small_store / "folder").mkdir()
    for name in ("fifo", "folder", "."):
        name_in_manifest(small_store, "shards.0", name)
        refused = rf"shards\[0\]\.file is '{re.escape(name)}': not a regular file"
        with within(10), pytest.raises(StoreCorrupt, match=refused):
            TeacherStore(small_store)
    # A link inside the store to a shard inside it is followed.
    (small_store / "linked").symlink_to("shard-000001.safetensors")
    name_in_manifest(small_store, "shards.0", "shard-000000.safetensors")
    name_in_manifest(small_store, "shards.1", "linked")
    read_all(small_store, setup)


def test_a_manifest_too_large_too_deep_or_not_a_regular_file_is_refused_before_it_is_parsed(small_store, outside):
    manifest = small_store / fmt.MANIFEST
    text = manifest.read_bytes()
    assert fmt.json_depth(text) <= fmt.MAX_MANIFEST_DEPTH
    # Deeper than the parser recurses: json.loads itself raises RecursionError.
    deep = b'{"format": "' + fmt.FORMAT.encode() + b'", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(RecursionError):
        json.loads(deep)
    manifest.write_bytes(deep)
    with pytest.raises(StoreCorrupt, match=rf"manifest\.json: not a readable manifest \(it nests 100001 deep, more "
                                           rf"than the {fmt.MAX_MANIFEST_DEPTH} it may\)"):
        TeacherStore(small_store)
    # Brackets inside strings are not nesting.
    manifest.write_bytes(text[:-2] + b', "note": "' + b"[{" * 1000 + b'"}\n')
    TeacherStore(small_store)

    # A manifest of 1 GiB (sparse: nothing to read but its size) is refused by its size, unread.
    manifest.write_bytes(text)
    os.truncate(manifest, 1 << 30)
    rchar = lambda: int(re.search(r"^rchar: (\d+)$", Path("/proc/self/io").read_text(), re.M).group(1))  # noqa: E731
    before = rchar()
    too_long = r"manifest\.json is longer than 16 MiB \(MAX_MANIFEST_BYTES\)"
    with within(10), pytest.raises(StoreCorrupt, match=too_long):
        TeacherStore(small_store)
    assert rchar() - before < 1 << 16

    for target in ("fifo", "secret"):
        manifest.unlink()
        manifest.symlink_to(outside[target])
        with within(10), pytest.raises(StoreCorrupt, match=rf"manifest\.json is 'manifest\.json': {OUTSIDE}"):
            TeacherStore(small_store)


def test_shapes_beyond_the_teachers_the_store_describes_are_refused_before_anything_is_allocated(setup, tmp_path):
    """A manifest stating a hidden size of 2**20, with a sparse shard of the size, header and digests
    that agree with it (rows of 96 MiB each, 805 MB for 8): refused by the teacher facts' bound
    when the store is opened, before any row is read."""
    import hashlib

    store = tmp_path / "s"
    fill(store, setup, local_teacher(setup, (FinalHidden(),)), batches(setup["dataset"])[:2])
    manifest = json.loads((store / fmt.MANIFEST).read_text())
    manifest["teacher"]["facts"]["hidden_size"] = 1 << 20
    manifest["head"] = None  # a head of 300 x 2**20 is not needed to make the point
    facts = fmt.facts_from_json(manifest["teacher"]["facts"])
    request = OutputRequest.resolve(fmt.spec_from_json(manifest["outputs"]["spec"]), facts)
    codecs = fmt.codecs_for(request, SEQ)
    manifest["outputs"]["tensors"] = [codec.to_json() for codec in codecs]
    rows = manifest["shards"][0]["rows"]
    specs = {fmt.ROW_KEY: (torch.uint8, (rows, 32)), fmt.ROW_SHA256: (torch.uint8, (rows, 32)),
             **{codec.name: (codec.dtype, (rows, *codec.row_shape)) for codec in codecs}}
    header, places = fmt.shard_layout(specs)
    shard = store / manifest["shards"][0]["file"]
    shard.write_bytes(header)
    size = max(place.end for place in places.values())
    os.truncate(shard, size)  # sparse: zeros
    zeros = hashlib.sha256(bytes(32 * rows)).hexdigest()
    manifest["shards"] = [{**manifest["shards"][0], "bytes": size, "row_keys_sha256": zeros, "row_sha256_sha256": zeros,
                           "header_sha256": hashlib.sha256(header).hexdigest()}]
    fmt.write_manifest(store, manifest)
    assert size > 8 * SEQ * (1 << 20) * 4
    with pytest.raises(StoreCorrupt, match=r"manifest\.json: teacher\.facts\.hidden_size is 1048576, outside "
                                           r"\[0, 65536\], the largest a store describes"):
        TeacherStore(store)


@pytest.mark.parametrize("field,value,says", [
    ("rows", "8", r"shards\[1\]\.rows is '8', not a whole number above 0"),
    ("bytes", -1, r"shards\[1\]\.bytes is -1, not a whole number, 0 or more"),
    ("file", ["shard-000001.safetensors"], r"shards\[1\]\.file is \['shard-000001\.safetensors'\], not a file name"),
    ("sha256", "00", r"shards\[1\]\.sha256 is '00', not a sha256"),
])
def test_a_malformed_shard_entry_is_refused_naming_its_field(small_store, field, value, says):
    manifest = json.loads((small_store / fmt.MANIFEST).read_text())
    manifest["shards"][1][field] = value
    fmt.write_manifest(small_store, manifest)
    with pytest.raises(StoreCorrupt, match=rf"manifest\.json: malformed: {says}"):
        TeacherStore(small_store)


def test_writers_never_write_through_a_link_planted_at_their_temporary_names(small_store, outside):
    before = outside["secret"].read_bytes()
    planted = small_store / f".{fmt.MANIFEST}.tmp-{os.getpid()}"
    planted.symlink_to(outside["secret"])
    manifest = json.loads((small_store / fmt.MANIFEST).read_text())
    fmt.write_manifest(small_store, manifest)
    assert outside["secret"].read_bytes() == before
    assert json.loads((small_store / fmt.MANIFEST).read_text()) == manifest
    (small_store / fmt.LOCK_FILE).unlink(missing_ok=True)
    (small_store / fmt.LOCK_FILE).symlink_to(outside["absent"])
    with pytest.raises(StoreError, match=r"\.lock: cannot open the store's lock"):
        with fmt.locked(small_store):
            pass
    assert not outside["absent"].exists()

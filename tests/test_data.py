"""Unit tests of the data side: the demo corpus and tokenizer, and the student's pipeline."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from distill_demo.corpus import write_jsonl_corpus
from distill_demo.tokenizer import (
    CHAT_TEMPLATE,
    TokenizerCacheError,
    load_or_train_tokenizer,
    train_tokenizer,
)
from student_trainer.data import (
    BatchIterator,
    DataError,
    PackedDataset,
    ReadStats,
    ResumeStateError,
    TokenizerSetupError,
    read_jsonl,
    tokenize_record,
)
from transformers import PreTrainedTokenizerFast

TINY_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "for i in range(10):\n    print(i, i * i)\n",
    "Hello, world! How are you today? I am fine, thank you.\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 3


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(TINY_TEXTS, vocab_size=320, save_dir=directory)
    return directory


@pytest.fixture
def tokenizer(tokenizer_dir):
    # A fresh load per test, so a test that edits it (chat_template = None) affects no other.
    return PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))


def write_lines(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def text_records(count):
    return [{"text": " ".join(f"w{i}x{j}" for j in range(5))} for i in range(count)]


# --- tokenizer ---------------------------------------------------------------------------


def test_tokenizer_round_trips_any_text(tokenizer):
    samples = ["def f(x):\n\treturn x , y .", "  leading and trailing  ", "héllo 世界 🎉\r\n", "", "a\x00b"]
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|eos|>" and tokenizer.bos_token == "<|bos|>"
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_tokenizer_training_is_deterministic(tokenizer):
    again = train_tokenizer(TINY_TEXTS, vocab_size=320)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again.backend_tokenizer.to_str() == train_tokenizer(TINY_TEXTS, vocab_size=320).backend_tokenizer.to_str()


def test_chat_template_marks_assistant_tokens_and_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello, friend!"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|system|>\nBe brief.<|eos|>\n<|user|>\nHi?<|eos|>\n<|assistant|>\nHello, friend!<|eos|>"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("Hi?<|eos|>\n<|assistant|>\n")
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(marked) == "Hello, friend!<|eos|>"


def test_load_or_train_tokenizer_caches(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return TINY_TEXTS

    first = load_or_train_tokenizer(tmp_path / "tok", texts, vocab_size=300)
    second = load_or_train_tokenizer(tmp_path / "tok", texts, vocab_size=300)
    assert len(calls) == 1
    assert first.get_vocab() == second.get_vocab()
    assert second.chat_template == CHAT_TEMPLATE
    with pytest.raises(TokenizerCacheError, match="delete"):
        load_or_train_tokenizer(tmp_path / "tok", texts, vocab_size=400)


# --- corpus ------------------------------------------------------------------------------


def test_corpus_split_is_disjoint_by_file_and_deterministic(tmp_path):
    train_path, heldout_path = write_jsonl_corpus(tmp_path / "a", seq_chars=500, heldout_fraction=0.2, max_files=30)
    sources = {}
    for split, path in (("train", train_path), ("heldout", heldout_path)):
        records = [record for _, record in read_jsonl(path)]
        assert records and all(0 < len(record["text"]) <= 500 for record in records)
        sources[split] = {record["source"] for record in records}
    assert sources["train"] and sources["heldout"]
    assert not sources["train"] & sources["heldout"]
    assert len(sources["train"] | sources["heldout"]) <= 30
    assert not any("test/" in source or source.startswith("test") for source in sources["train"])

    again = write_jsonl_corpus(tmp_path / "b", seq_chars=500, heldout_fraction=0.2, max_files=30)
    assert [p.read_bytes() for p in again] == [train_path.read_bytes(), heldout_path.read_bytes()]


# --- masking per shape -------------------------------------------------------------------


def test_text_record_trains_on_every_token_and_ends_with_eos(tokenizer):
    ids, mask = tokenize_record({"text": "def add(a, b):"}, tokenizer)
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == "def add(a, b):"
    assert mask == [1] * len(ids)


def _with_bos(tokenizer):
    """The same tokenizer with a Llama/Gemma-style convention: `tokenizer(text)` puts its bos first."""
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>",
                                      pad_token=tokenizer.pad_token)
    assert wrapped("def")["input_ids"][0] == wrapped.bos_token_id != wrapped("def", add_special_tokens=False)[
        "input_ids"][0]
    return wrapped


def test_documents_begin_with_the_bos_of_a_tokenizer_whose_convention_has_one(tokenizer):
    bos_first = _with_bos(tokenizer)
    bos = bos_first.bos_token_id
    plain_ids, plain_mask = tokenize_record({"text": "def add(a, b):"}, tokenizer)
    assert plain_ids[0] != bos  # the tests' tokenizer puts nothing first: no bos is invented
    ids, mask = tokenize_record({"text": "def add(a, b):"}, bos_first)
    assert ids == [bos] + plain_ids and mask == [0] + plain_mask  # the bos is context, not a target
    ids, mask = tokenize_record({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, bos_first)
    plain_ids, plain_mask = tokenize_record({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, tokenizer)
    assert ids == [bos] + plain_ids and mask == [0] + plain_mask
    bos_first.chat_template = None
    ids, mask = tokenize_record({"messages": [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello!"}]}, bos_first)
    assert ids[0] == bos and mask[0] == 0 and ids.count(bos) == 1
    # Packed: each document starts with one, wherever it falls in a row.
    records = [{"text": "w1 w2 w3"}, {"text": "x1 x2"}, {"text": "y1"}]
    dataset = PackedDataset.from_records(records, bos_first, seq_len=8, mode="pack")
    stream = dataset.input_ids[dataset.attention_mask.bool()].tolist()
    starts = [0] + [i + 1 for i, token in enumerate(stream[:-1]) if token == bos_first.eos_token_id]
    assert [stream[i] for i in starts] == [bos] * 3 and stream.count(bos) == 3


def test_prompt_completion_trains_on_completion_only(tokenizer):
    ids, mask = tokenize_record({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, tokenizer)
    prompt_ids = [i for i, m in zip(ids, mask) if not m]
    completion_ids = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(prompt_ids) == "Q: 2+2?\nA:"
    assert tokenizer.decode(completion_ids) == " 4<|eos|>"
    # The prompt comes first, as one block.
    assert mask == sorted(mask)


def test_messages_train_on_assistant_turns_only(tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "See you."},
        ]
    }
    ids, mask = tokenize_record(record, tokenizer)
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "Hello!<|eos|>See you.<|eos|>"
    assert "Hi" in tokenizer.decode([i for i, m in zip(ids, mask) if not m])


def test_messages_without_chat_template_use_plain_rendering(tokenizer):
    tokenizer.chat_template = None
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    ids, mask = tokenize_record(record, tokenizer)
    assert tokenizer.decode(ids) == "user: Hi\nassistant: Hello!\n<|eos|>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "Hello!<|eos|>"


def test_chat_template_without_generation_markers_is_refused(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(TokenizerSetupError, match="generation"):
        tokenize_record({"messages": [{"role": "assistant", "content": "x"}]}, tokenizer)


def test_chat_template_errors_name_the_line(tmp_path, tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    path = write_lines(tmp_path / "chat.jsonl", [b'{"text": "ok"}', b'{"messages": [{"role": "system", "content": "x"}]}'])
    with pytest.raises(DataError, match=f"{path}:2: .*no system turns"):
        PackedDataset(path, tokenizer, seq_len=8)


# --- bad lines ---------------------------------------------------------------------------

BAD_LINES = {
    "invalid JSON": b'{"text": "unterminated',
    "not an object": b'["text", "a list"]',
    "bare number": b"42",
    "no shape": b'{"txt": "typo"}',
    "text not a string": b'{"text": 5}',
    "empty text": b'{"text": ""}',
    "completion missing": b'{"prompt": "only a prompt"}',
    "mixed shapes": b'{"text": "a", "prompt": "b", "completion": "c"}',
    "messages not a list": b'{"messages": "hi"}',
    "empty messages": b'{"messages": []}',
    "unknown role": b'{"messages": [{"role": "bot", "content": "x"}]}',
    "content not a string": b'{"messages": [{"role": "user", "content": 3}]}',
    "invalid UTF-8": b'{"text": "\xff\xfe"}',
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_line_is_reported_with_its_line_number(tmp_path, kind):
    # Line 1 valid, line 2 blank, line 3 bad.
    path = write_lines(tmp_path / "data.jsonl", [b'{"text": "fine"}', b"", BAD_LINES[kind]])
    with pytest.raises(DataError) as excinfo:
        list(read_jsonl(path))
    message = str(excinfo.value)
    assert message.startswith(f"{path}:3: ")
    assert "expected one of" in message


def test_skip_bad_lines_counts_and_logs_them(tmp_path, caplog, tokenizer):
    lines = [b'{"text": "one"}', BAD_LINES["invalid JSON"], b'{"prompt": "p", "completion": "c"}', BAD_LINES["unknown role"]]
    path = write_lines(tmp_path / "data.jsonl", lines)
    stats = ReadStats()
    with caplog.at_level(logging.WARNING, logger="student_trainer.data"):
        got = list(read_jsonl(path, skip_bad_lines=True, stats=stats))
    assert [line for line, _ in got] == [1, 3]
    assert (stats.records, stats.skipped_bad_lines) == (2, 2)
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"{path}:2:" in warnings and f"{path}:4:" in warnings

    dataset = PackedDataset(path, tokenizer, seq_len=8, skip_bad_lines=True)
    assert dataset.stats.skipped_bad_lines == 2 and dataset.stats.records == 2


# --- fixed-length examples ---------------------------------------------------------------


def test_pack_mode_concatenates_documents_into_full_chunks(tokenizer):
    records = text_records(7)
    documents = [tokenize_record(record, tokenizer) for record in records]
    stream = [token for ids, _ in documents for token in ids]
    dataset = PackedDataset.from_records(records, tokenizer, seq_len=16)
    assert len(dataset) == -(-len(stream) // 16)
    example = dataset[0]
    assert set(example) == {"input_ids", "attention_mask", "loss_mask"}
    assert all(t.shape == (16,) and t.dtype == torch.int64 for t in example.values())
    flat_attention = dataset.attention_mask.flatten()
    assert flat_attention.sum() == len(stream)
    assert dataset.input_ids.flatten()[: len(stream)].tolist() == stream
    # Only the tail of the last chunk is padding, and padding is never trained on.
    assert flat_attention[: len(stream)].all() and not flat_attention[len(stream) :].any()
    assert not dataset.loss_mask.flatten()[len(stream) :].any()
    assert dataset.input_ids.flatten()[len(stream) :].eq(tokenizer.pad_token_id).all()


def test_truncate_mode_is_one_document_per_example(tokenizer):
    records = [{"text": "short"}, {"text": "a much longer document " * 10}, {"prompt": "p", "completion": "c"}]
    dataset = PackedDataset.from_records(records, tokenizer, seq_len=12, mode="truncate")
    assert dataset.input_ids.shape == dataset.attention_mask.shape == dataset.loss_mask.shape == (3, 12)
    short_ids, _ = tokenize_record(records[0], tokenizer)
    row = dataset[0]
    assert row["input_ids"][: len(short_ids)].tolist() == short_ids
    assert row["attention_mask"].tolist() == [1] * len(short_ids) + [0] * (12 - len(short_ids))
    assert not row["loss_mask"][len(short_ids) :].any()
    assert row["input_ids"][len(short_ids) :].eq(tokenizer.pad_token_id).all()
    assert dataset.attention_mask[1].all()
    assert dataset.stats.truncated_documents == 1
    # prompt/completion keeps its mask: prompt tokens 0, completion and eos 1, then padding 0.
    assert dataset.loss_mask[2].tolist()[: dataset.attention_mask[2].sum()].count(1) >= 2


def test_empty_dataset_is_an_error(tmp_path, tokenizer):
    path = write_lines(tmp_path / "data.jsonl", [BAD_LINES["no shape"]])
    with pytest.raises(DataError, match="no usable records"):
        PackedDataset(path, tokenizer, seq_len=8, skip_bad_lines=True)


# --- batches: sharding and resume --------------------------------------------------------


@pytest.fixture
def truncated_dataset(tokenizer):
    return PackedDataset.from_records(text_records(26), tokenizer, seq_len=6, mode="truncate")


def test_ranks_get_disjoint_batches_covering_the_epoch(truncated_dataset):
    batch_size, world_size = 3, 4
    iterators = [
        BatchIterator(truncated_dataset, batch_size, seed=7, rank=rank, world_size=world_size)
        for rank in range(world_size)
    ]
    assert iterators[0].steps_per_epoch == 26 // 12
    seen = []
    for step in range(iterators[0].steps_per_epoch):
        for it in iterators:
            indices = it.batch_indices(0, step)
            batch = next(it)
            assert batch["input_ids"].shape == (batch_size, 6)
            assert torch.equal(batch["input_ids"], truncated_dataset.input_ids[indices])
            seen += indices.tolist()
    # 24 of 26 examples: disjoint, and all but the 26 % 12 that do not fill a global batch.
    assert len(seen) == len(set(seen)) == 24
    assert all(it.epoch == 1 and it.position == 0 for it in iterators)
    # With a dataset that divides evenly, the ranks cover every example.
    even = BatchIterator(truncated_dataset, 13, seed=7, rank=0, world_size=2)
    covered = even.batch_indices(0, 0, rank=0).tolist() + even.batch_indices(0, 0, rank=1).tolist()
    assert sorted(covered) == list(range(26))


def test_epochs_reshuffle_deterministically(truncated_dataset):
    a = BatchIterator(truncated_dataset, 2, seed=1)
    b = BatchIterator(truncated_dataset, 2, seed=1)
    assert torch.equal(a.permutation(0), b.permutation(0))
    assert not torch.equal(a.permutation(0), a.permutation(1))
    assert not torch.equal(a.permutation(0), BatchIterator(truncated_dataset, 2, seed=2).permutation(0))


def test_resume_gives_the_identical_next_batches(truncated_dataset):
    def make(rank):
        return BatchIterator(truncated_dataset, 2, seed=3, rank=rank, world_size=2, num_epochs=3)

    uninterrupted = {rank: [b["input_ids"] for b in make(rank)] for rank in range(2)}
    assert len(uninterrupted[0]) == 3 * (26 // 4)
    interrupted = {rank: make(rank) for rank in range(2)}
    for it in interrupted.values():
        for _ in range(8):  # past the first epoch boundary (6 steps per epoch)
            next(it)
    # Every rank holds the same state, so rank 0's checkpoint resumes them all.
    assert interrupted[0].state_dict() == interrupted[1].state_dict()
    # Through JSON, as a checkpoint would store it.
    state = json.loads(json.dumps(interrupted[0].state_dict()))
    assert (state["epoch"], state["position"]) == (1, 2)
    for rank in range(2):
        resumed = make(rank)
        resumed.load_state_dict(state)
        rest = [b["input_ids"] for b in resumed]
        assert len(rest) == len(uninterrupted[rank]) - 8
        assert all(torch.equal(x, y) for x, y in zip(rest, uninterrupted[rank][8:]))


def test_resume_refuses_a_state_from_other_data_or_settings(truncated_dataset, tokenizer):
    state = BatchIterator(truncated_dataset, 2, seed=3).state_dict()
    with pytest.raises(ResumeStateError, match="seed"):
        BatchIterator(truncated_dataset, 2, seed=4).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="world_size"):
        BatchIterator(truncated_dataset, 2, seed=3, world_size=2).load_state_dict(state)
    # Same size, same examples, other order: only the fingerprint tells them apart.
    other = PackedDataset.from_records(text_records(26)[::-1], tokenizer, seq_len=6, mode="truncate")
    with pytest.raises(ResumeStateError, match="data_fingerprint"):
        BatchIterator(other, 2, seed=3).load_state_dict(state)


def test_too_little_data_for_one_global_batch_names_the_fix(truncated_dataset):
    with pytest.raises(DataError, match="lower batch_size"):
        BatchIterator(truncated_dataset, 7, world_size=4)

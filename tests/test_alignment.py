"""Two tokenizations aligned on the bytes of the text, and the cross-tokenizer output kinds,
against straightforward references written here (loops over byte offsets, no tensors).

The tokenizers are built by hand (a byte-level BPE whose merges the test chooses, a
SentencePiece-style one trained on a few lines), so each hard case is a case on purpose: a
student token that spans two teacher tokens and the reverse, a multi-byte character split
differently, leading spaces ("Ġ" against "▁"), digits split differently, special tokens,
padding on either side, a row cut inside a character.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tokenizers import SentencePieceBPETokenizer, Tokenizer, decoders, models, pre_tokenizers
from tokenizers import AddedToken

from distill_common.alignment import (AlignmentError, BatchTooLarge, StudentVocabulary, TeacherTokenizer,
                                      VocabularyMatch, align_batch, row_texts, vocabulary_bytes)
from distill_common.outputs import (ALIGNMENT, BatchOutputs, OutputRequest, OutputSpecError, ProjectedNext,
                                    SortedProbs, SpanLogprobs, TeacherFacts, TopK, output_spec)
from distill_common.proto.teacher.v1 import teacher_pb2 as pb

# GPT-2's byte-to-symbol table, written out here independently of the module's inverse.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


def _symbol_table() -> dict[int, str]:
    table, extra = {b: chr(b) for b in _PRINTABLE}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


SYMBOL = _symbol_table()


def byte_level(text: bytes) -> str:
    return "".join(SYMBOL[b] for b in text)


def byte_level_tokenizer(merged: list[bytes], special: tuple[str, ...] = ("<|eos|>",)) -> Tokenizer:
    """A byte-level BPE: the 256 byte symbols, then `merged` pieces (each built from the previous
    pieces by the merges listed, in order), then `special` tokens."""
    vocab = {SYMBOL[b]: b for b in range(256)}
    merges = []
    for piece in merged:
        # Merge left to right from known pieces: the longest known prefix, then the rest.
        left = max((p for p in vocab if byte_level(piece).startswith(p) and p != byte_level(piece)), key=len)
        right = byte_level(piece)[len(left):]
        assert right in vocab, f"{piece!r}: {right!r} must be a piece already"
        merges.append((left, right))
        vocab[byte_level(piece)] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in special])
    return tokenizer


TEACHER_MERGES = [b"he", b"ll", b"llo", b" w", b"or", b" wor", b"ld", b"12", b"34", b"\xc3\xa9", b"ca", b"caf",
                  b"caf\xc3\xa9", b" 1", b"ab", b"abc"]
STUDENT_MERGES = [b"he", b"hel", b"hell", b"hello", b" w", b" wo", b"rl", b"rld", b"23", b"234", b" 1", b"ca",
                  b"a\xc3", b"bc"]


@pytest.fixture(scope="module")
def teacher():
    return TeacherTokenizer(byte_level_tokenizer(TEACHER_MERGES))


@pytest.fixture(scope="module")
def student_vocab():
    return StudentVocabulary.of(byte_level_tokenizer(STUDENT_MERGES, special=("<|pad|>", "<|eos|>")))


def ids_of(vocabulary: StudentVocabulary, pieces: list[bytes]) -> list[int]:
    index = {}
    for i, piece in enumerate(vocabulary.pieces):
        index.setdefault(piece, i)
    return [index[p] for p in pieces]


# ---- the references -----------------------------------------------------------------------

def reference_spans(student_pieces: list[bytes], teacher_pieces: list[bytes], token_logprobs: list[float]):
    """Per student token k >= 1 (indexed by the position before it, k - 1): the sum of the
    teacher token log-probabilities whose last byte lies in token k (teacher token 0 excluded),
    and whether both of token k's edges are teacher boundaries."""
    s_start, s_end, offset = [], [], 0
    for piece in student_pieces:
        s_start.append(offset)
        offset += len(piece)
        s_end.append(offset)
    t_start, t_end, offset = [], [], 0
    for piece in teacher_pieces:
        t_start.append(offset)
        offset += len(piece)
        t_end.append(offset)
    values, exact = [0.0] * len(student_pieces), [False] * len(student_pieces)
    for k in range(1, len(student_pieces)):
        a, b = s_start[k], s_end[k]
        total, has_first = 0.0, False
        for j in range(len(teacher_pieces)):
            if a <= t_end[j] - 1 < b:
                if j == 0:
                    has_first = True
                else:
                    total += token_logprobs[j]
        values[k - 1] = total
        exact[k - 1] = b > a and a in t_start and b in t_end and not has_first
    return values, exact


def reference_context(student_pieces: list[bytes], teacher_pieces: list[bytes]) -> list[int]:
    """Per student position (not the last): the teacher token that ends where its text ends, or -1."""
    t_end, offset = [], 0
    for piece in teacher_pieces:
        offset += len(piece)
        t_end.append(offset)
    context, offset = [], 0
    for k, piece in enumerate(student_pieces):
        offset += len(piece)
        context.append(t_end.index(offset) if offset > 0 and offset in t_end and k < len(student_pieces) - 1 else -1)
    return context


def reference_match(student: list[bytes], teacher: list[bytes], by_prefix: bool = False):
    """The student ids that receive teacher mass, and from which teacher ids: exact, each teacher
    id to the lowest student id of the same bytes; by prefix, to the lowest id of the longest
    student piece its bytes start with."""
    sources: dict[int, list[int]] = {}
    for v, piece in enumerate(teacher):
        candidates = [u for u, s in enumerate(student) if s and (piece == s or by_prefix and piece.startswith(s))]
        if piece and candidates:
            best = min(candidates, key=lambda u: (-len(student[u]), u))
            sources.setdefault(best, []).append(v)
    return sorted(sources), sources


# ---- vocabularies -----------------------------------------------------------------------

def test_byte_level_pieces_are_their_bytes_and_special_tokens_none():
    tokenizer = byte_level_tokenizer([b" w", b"\xc3\xa9"])
    pieces = vocabulary_bytes(tokenizer)
    vocab = tokenizer.get_vocab()
    assert pieces[vocab["Ġw"]] == b" w"  # "Ġ" is the space's symbol
    assert pieces[vocab["Ã©"]] == "é".encode()
    assert pieces[vocab["<|eos|>"]] == b""
    assert all(pieces[vocab[SYMBOL[b]]] == bytes([b]) for b in range(256))


def test_sentencepiece_pieces_turn_the_meta_space_into_a_space():
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(["hello world 1234", "the world of 56"], vocab_size=120, show_progress=False,
                           special_tokens=["<unk>"])
    pieces = vocabulary_bytes(sp)
    vocab = sp.get_vocab()
    assert pieces[vocab["▁world"]] == b" world"
    assert pieces[vocab["<unk>"]] == b""
    ids = sp.encode("hello world").ids
    assert b"".join(pieces[i] for i in ids) == b" hello world"  # the prefix space SentencePiece adds


def test_byte_fallback_pieces_are_one_byte():
    assert vocabulary_bytes(_sentencepiece_with_byte_pieces())[3] == b"\xe2"


def _sentencepiece_with_byte_pieces() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab={"<unk>": 0, "▁": 1, "a": 2, "<0xE2>": 3}, merges=[], byte_fallback=True,
                                     unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    tokenizer.add_special_tokens([AddedToken("<unk>", special=True)])
    return tokenizer


def test_the_match_is_exact_strings_once_each(student_vocab, teacher):
    match = VocabularyMatch.build(student_vocab.pieces, teacher.pieces)
    matched, sources = reference_match(list(student_vocab.pieces), teacher.pieces)
    assert match.student_ids.tolist() == matched
    for column, u in enumerate(matched):
        assert sorted(np.nonzero(match.teacher_column == column)[0].tolist()) == sources[u]
    # Everything else is unmatched mass: special tokens and pieces only one side has.
    unmatched = {v for v in range(len(teacher.pieces)) if not any(v in s for s in sources.values())}
    assert set(np.nonzero(match.teacher_column == len(matched))[0].tolist()) == unmatched
    assert teacher.pieces.index(b"") in unmatched  # <|eos|> never matches


def test_the_prefix_match_takes_the_longest_student_prefix(student_vocab, teacher):
    match = VocabularyMatch.build(student_vocab.pieces, teacher.pieces, by_prefix=True)
    matched, sources = reference_match(list(student_vocab.pieces), teacher.pieces, by_prefix=True)
    assert match.student_ids.tolist() == matched
    for column, u in enumerate(matched):
        assert sorted(np.nonzero(match.teacher_column == column)[0].tolist()) == sources[u]
    # the teacher's "llo" goes to the student's "l", its "caf\xc3\xa9" to "ca"; only special tokens stay unmatched
    column_of = dict(zip(match.student_ids.tolist(), range(match.size)))
    assert match.teacher_column[teacher.pieces.index(b"llo")] == column_of[student_vocab.pieces.index(b"l")]
    assert match.teacher_column[teacher.pieces.index(b"caf\xc3\xa9")] == column_of[student_vocab.pieces.index(b"ca")]
    assert [teacher.pieces[v] for v in np.nonzero(match.teacher_column == match.size)[0]] == [b""]


def test_a_student_piece_twice_takes_one_column():
    match = VocabularyMatch.build([b"a", b"b", b"a", b""], [b"a", b"", b"a", b"c"])
    assert match.student_ids.tolist() == [0]
    assert match.teacher_column.tolist() == [0, 1, 0, 1]


# ---- alignment: hard cases -----------------------------------------------------------------

HARD_ROWS = {
    # student "hello" spans teacher "he" + "llo"; student " wo" + "rld" against teacher " wor" + "ld"
    "student spans two teacher tokens": [b"hello", b" wo", b"rld"],
    # student "he" + "l" + "l" + "o": teacher "he" + "llo", one teacher token over three student tokens
    "teacher spans several student tokens": [b"he", b"l", b"l", b"o", b" w"],
    # "é" is c3 a9: one teacher token, two student tokens ("a\xc3" then "\xa9")
    "multi-byte character split differently": [b"c", b"a\xc3", b"\xa9", b" w"],
    # digits: teacher "12" "34", student " 1" "234"
    "digits split differently": [b" 1", b"234", b"1", b"2"],
    # a special token (no text) inside the row
    "special token": [b"hel", b"", b"l", b"o", b"bc"],
}


def _align_rows(rows: list[list[bytes]], vocabulary, teacher, pad_left: bool = False, width: int | None = None,
                by_prefix: bool = False):
    width = width or max(len(r) for r in rows) + 1
    pad = ids_of(vocabulary, [b""])[0]  # any id: padding is not read
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for r, pieces in enumerate(rows):
        start = width - len(pieces) if pad_left else 0
        ids[r, start:start + len(pieces)] = torch.tensor(ids_of(vocabulary, pieces))
        mask[r, start:start + len(pieces)] = 1
    texts = row_texts(ids, mask, vocabulary)
    match = VocabularyMatch.build(vocabulary.pieces, teacher.pieces, by_prefix=by_prefix)
    return ids, mask, texts, align_batch(ids, mask, texts, vocabulary, teacher, match, max_teacher_tokens=64)


# extra_rows: the teacher's embedding has more rows than its tokenizer has entries (Qwen's
# 151,936 against 151,665): the logits are that much wider, and those ids spell nothing.
@pytest.mark.parametrize("pad_left, by_prefix, extra_rows", [(False, False, 0), (True, False, 0), (False, True, 0),
                                                            (False, False, 64), (False, True, 64)])
def test_hard_cases_align_as_the_reference_says(student_vocab, teacher, pad_left, by_prefix, extra_rows):
    rows = list(HARD_ROWS.values())
    ids, mask, texts, aligned = _align_rows(rows, student_vocab, teacher, pad_left=pad_left, by_prefix=by_prefix)
    width = len(teacher.pieces) + extra_rows
    logits = torch.randn(*aligned.teacher_ids.shape, width, generator=torch.Generator().manual_seed(1))
    request = OutputRequest.resolve(output_spec([SpanLogprobs(), ProjectedNext(3), SortedProbs(4)]),
                                    facts_of(teacher, width))
    request = request.aligned(len(student_vocab), aligned.match.size)
    batch = _Batch(aligned)
    span, exact, projected, mass, rest, top = request.derive(BatchOutputs(logits), batch)
    assert [tuple(t.shape) for t in (span, exact, projected, mass, rest, top)] == [
        tuple(s.shape) for s in request.layout(*ids.shape)]
    matched, sources = reference_match(list(student_vocab.pieces), teacher.pieces, by_prefix)
    for r, pieces in enumerate(rows):
        positions = mask[r].nonzero()[:, 0].tolist()
        t_ids = aligned.teacher_ids[r][aligned.teacher_mask[r].bool()].tolist()
        t_pieces = [teacher.pieces[i] for i in t_ids]
        assert b"".join(t_pieces) == texts[r] == b"".join(pieces)
        log_probs = torch.log_softmax(logits[r].double(), -1)
        token_logprobs = [0.0] + [log_probs[j - 1, t_ids[j]].item() for j in range(1, len(t_ids))]
        want_values, want_exact = reference_spans(pieces, t_pieces, token_logprobs)
        want_context = reference_context(pieces, t_pieces)
        for k, t in enumerate(positions):
            assert span[r, t].item() == pytest.approx(want_values[k], abs=1e-4), (r, k)
            assert bool(exact[r, t]) == want_exact[k], (r, k, pieces)
            if want_context[k] < 0:
                assert projected[r, t].abs().sum() == mass[r, t] == top[r, t].abs().sum() == 0
                continue
            probs = torch.softmax(logits[r, want_context[k]].double(), -1)
            for column, u in enumerate(matched):
                assert projected[r, t, column].item() == pytest.approx(probs[sources[u]].sum().item(), abs=1e-6)
            unmatched = [v for v in range(width) if not any(v in s for s in sources.values())]
            assert mass[r, t].item() == pytest.approx(probs[unmatched].sum().item(), abs=1e-5)
            want_rest = (sorted(probs[unmatched].tolist(), reverse=True) + [0.0] * 3)[:3]  # zeros past the last
            assert rest[r, t].tolist() == pytest.approx(want_rest, abs=1e-6)
            assert top[r, t].tolist() == pytest.approx(sorted(probs.tolist(), reverse=True)[:4], abs=1e-6)
            assert projected[r, t].sum().item() + mass[r, t].item() == pytest.approx(1.0, abs=1e-5)
        padding = [t for t in range(ids.shape[1]) if t not in positions]
        assert all(span[r, t] == 0 and not exact[r, t] and projected[r, t].abs().sum() == 0 for t in padding)


def test_the_hard_cases_do_what_their_names_say(student_vocab, teacher):
    _, mask, _, aligned = _align_rows(list(HARD_ROWS.values()), student_vocab, teacher)
    exact = aligned.span_exact
    # "hello" | " wo" | "rld": " wo" ends inside " wor", so neither " wo" nor "rld" is exact, and no teacher
    # position has seen exactly "hello wo"
    assert not exact[0, 0] and not exact[0, 1] and aligned.context[0, 1] == -1 and aligned.context[0, 0] >= 0
    # "he" "l" "l" "o": the teacher's "llo" counts for "o" (its last byte), not for the two "l"s
    owner = aligned.span_owner[1][aligned.teacher_mask[1].bool()].tolist()
    assert owner[:2] == [aligned.student_shape[1], 2]  # "he" has no context; "llo" goes to the position before "o"
    # "a\xc3" and "\xa9": "é" ends in "\xa9", so it counts there; the text before "\xa9" ends inside "é"
    assert aligned.context[2, 1] == -1 and aligned.context[2, 2] >= 0
    # the special token: its position is about an empty text (never exact); the text runs on across it
    assert not exact[4, 0] and not exact[4, 1]


def test_leading_spaces_align_between_byte_level_and_sentencepiece(teacher):
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(["hello world 1234 café", "world hello abc"] * 3, vocab_size=140, show_progress=False,
                           special_tokens=["<unk>"])
    vocabulary = StudentVocabulary.of(sp)
    encoded = sp.encode("hello world 1234")
    ids = torch.tensor([encoded.ids])
    mask = torch.ones_like(ids)
    texts = row_texts(ids, mask, vocabulary)
    assert texts == [b" hello world 1234"]  # "▁" stands for the space SentencePiece puts first
    match = VocabularyMatch.build(vocabulary.pieces, teacher.pieces)
    aligned = align_batch(ids, mask, texts, vocabulary, teacher, match, max_teacher_tokens=64)
    t_pieces = [teacher.pieces[i] for i in aligned.teacher_ids[0].tolist()]
    assert b"".join(t_pieces) == b" hello world 1234"
    assert b" wor" in t_pieces  # the teacher's byte-level "Ġwor" spells the same space
    pieces = [vocabulary.pieces[i] for i in encoded.ids]
    assert aligned.context[0].tolist() == reference_context(pieces, t_pieces)


def test_a_row_cut_inside_a_character_takes_the_teachers_byte_tokens(student_vocab, teacher):
    pieces = [b"\xa9", b" w", b"a\xc3"]  # begins after a character's first byte, ends before its second
    _, _, texts, aligned = _align_rows([pieces], student_vocab, teacher)
    t_ids = aligned.teacher_ids[0][aligned.teacher_mask[0].bool()].tolist()
    assert b"".join(teacher.pieces[i] for i in t_ids) == b"\xa9 wa\xc3"
    assert teacher.pieces[t_ids[0]] == b"\xa9" and teacher.pieces[t_ids[-1]] == b"\xc3"


def test_text_that_reads_like_a_special_token_stays_text(student_vocab, teacher):
    text = b"<|eos|>"
    t_ids = teacher.encode(text).ids
    assert b"".join(teacher.pieces[i] for i in t_ids) == text and len(t_ids) == len(text)


# ---- refusals --------------------------------------------------------------------------------

def test_a_row_whose_text_and_ids_disagree_is_refused_naming_it(student_vocab, teacher):
    ids, mask, texts, _ = _align_rows([[b"hello"], [b"a", b"bc"]], student_vocab, teacher)
    match = VocabularyMatch.build(student_vocab.pieces, teacher.pieces)
    for bad, why in ((b"abd", "from byte 2"), (b"ab", "the text has 2"), (b"abcc", "the text has 4")):
        with pytest.raises(AlignmentError, match=f"row 1: its text and its ids disagree.*") as e:
            align_batch(ids, mask, [texts[0], bad], student_vocab, teacher, match, max_teacher_tokens=64)
        assert why in str(e.value)
    with pytest.raises(AlignmentError, match="student_text has 1 rows, input_ids 2"):
        align_batch(ids, mask, texts[:1], student_vocab, teacher, match, max_teacher_tokens=64)
    ids[0, 0] = len(student_vocab)
    with pytest.raises(AlignmentError, match="row 0: id .* outside the student vocabulary"):
        align_batch(ids, mask, texts, student_vocab, teacher, match, max_teacher_tokens=64)


def test_a_row_longer_in_the_teachers_tokens_than_its_limit_is_refused(student_vocab, teacher):
    ids, mask, texts, _ = _align_rows([[b"hello", b" wo", b"rld"]], student_vocab, teacher)
    match = VocabularyMatch.build(student_vocab.pieces, teacher.pieces)
    with pytest.raises(AlignmentError, match="row 0: the teacher's tokenizer makes 4 tokens .* --max-seq-len 3"):
        align_batch(ids, mask, texts, student_vocab, teacher, match, max_teacher_tokens=3)


def test_a_batch_too_large_in_the_teachers_tokens_is_refused_before_it_is_all_encoded(student_vocab):
    """Refused once known: from the rows' bytes before any is encoded, else after the row that shows it."""
    teacher = TeacherTokenizer(byte_level_tokenizer(TEACHER_MERGES))  # no merge of "z": a token a byte
    encoded = []
    encode = teacher.encode
    teacher.encode = lambda text, row=0: encoded.append(row) or encode(text, row)
    vocabulary = StudentVocabulary(student_vocab.pieces + (b"z" * 500, b"z" * 3000))
    match = VocabularyMatch.build(vocabulary.pieces, teacher.pieces)
    many = len(vocabulary) - 2
    ids, mask = torch.full((20, 1), many), torch.ones(20, 1, dtype=torch.int64)
    # 20 rows of 500 bytes: at least 20 x 100 tokens (the longest teacher piece is 5 bytes), within 2048;
    # the first row's 500 tokens show 20 x 500.
    with pytest.raises(BatchTooLarge, match="its 20 rows take at least 20 x 500 tokens .* --max-batch-tokens 2048"):
        align_batch(ids, mask, [b"z" * 500] * 20, vocabulary, teacher, match, 512, max_batch_tokens=2048)
    assert encoded == [0]
    encoded.clear()
    with pytest.raises(BatchTooLarge, match="its 4 rows take at least 4 x 600 tokens"):
        align_batch(torch.full((4, 1), many + 1), torch.ones(4, 1, dtype=torch.int64), [b"z" * 3000] * 4, vocabulary,
                    teacher, match, 4096, max_batch_tokens=2048)
    with pytest.raises(AlignmentError, match="row 0: its 3000 bytes of text make at least 600 tokens .* --max-seq-len"):
        align_batch(torch.full((1, 1), many + 1), torch.ones(1, 1, dtype=torch.int64), [b"z" * 3000], vocabulary,
                    teacher, match, 512)
    assert encoded == []
    aligned = align_batch(ids[:4], mask[:4], [b"z" * 500] * 4, vocabulary, teacher, match, 512, max_batch_tokens=2048)
    assert aligned.teacher_ids.shape == (4, 500) and encoded == [0, 1, 2, 3]


def test_a_vocabulary_over_the_limit_or_malformed_is_refused(student_vocab):
    message = pb.StudentVocabulary()
    student_vocab.to_proto(message)
    assert StudentVocabulary.from_proto(message, len(student_vocab)) == student_vocab
    with pytest.raises(AlignmentError, match=f"{len(student_vocab)} entries, more than the teacher's "
                                             f"--max-student-vocab {len(student_vocab) - 1}"):
        StudentVocabulary.from_proto(message, len(student_vocab) - 1)
    message.token_lengths[5] += 1
    with pytest.raises(AlignmentError, match="add up to .* send each piece's length"):
        StudentVocabulary.from_proto(message, len(student_vocab))
    with pytest.raises(AlignmentError, match="is empty"):
        StudentVocabulary.from_proto(pb.StudentVocabulary(), 10)
    huge = pb.StudentVocabulary(token_bytes=b"x" * 2000, token_lengths=[2000])
    with pytest.raises(AlignmentError, match="more than 12 x --max-student-vocab 100|a piece of 2000 bytes"):
        StudentVocabulary.from_proto(huge, 100)


def test_a_normalizing_teacher_tokenizer_is_refused_for_the_row():
    from tokenizers import normalizers

    tokenizer = byte_level_tokenizer([])
    tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(AlignmentError, match="row 3: the teacher's tokenizer does not reproduce"):
        TeacherTokenizer(tokenizer).encode(b"ABC", row=3)


def test_cross_tokenizer_kinds_are_not_mixed_with_kinds_of_the_teachers_tokens(teacher):
    with pytest.raises(OutputSpecError, match="a session asks for one or the other"):
        OutputRequest.resolve(output_spec([SpanLogprobs(), TopK(2)]), facts_of(teacher))
    with pytest.raises(OutputSpecError, match="sorted_topk 9999 must be between 1 and"):
        OutputRequest.resolve(output_spec([SortedProbs(9999)]), facts_of(teacher))


# ---- helpers -------------------------------------------------------------------------------

def facts_of(teacher, vocab_size: int = 0) -> TeacherFacts:
    """`vocab_size`: the logits' width, the embedding's rows (default: the tokenizer's entries)."""
    return TeacherFacts(vocab_size=vocab_size or len(teacher.pieces), hidden_size=8, num_layers=1,
                        dtype=torch.float32)


class _Batch:
    """What a kind's derive reads of a batch."""

    def __init__(self, aligned):
        self.data = {ALIGNMENT: aligned}
        self.input_ids, self.attention_mask = aligned.teacher_ids, aligned.teacher_mask


def test_reference_spans_sum_to_the_rows_log_likelihood(student_vocab, teacher):
    # The convention's promise: a row's span values add up to its teacher log-likelihood (less token 0).
    rows = list(HARD_ROWS.values())
    _, _, _, aligned = _align_rows(rows, student_vocab, teacher)
    logits = torch.randn(*aligned.teacher_ids.shape, len(teacher.pieces), generator=torch.Generator().manual_seed(2))
    request = OutputRequest.resolve(output_spec([SpanLogprobs()]), facts_of(teacher)).aligned(
        len(student_vocab), aligned.match.size)
    span, _ = request.derive(BatchOutputs(logits), _Batch(aligned))
    for r in range(len(rows)):
        t_ids = aligned.teacher_ids[r][aligned.teacher_mask[r].bool()].tolist()
        log_probs = torch.log_softmax(logits[r].double(), -1)
        total = sum(log_probs[j - 1, t_ids[j]].item() for j in range(1, len(t_ids)))
        # less what lies in the student's first token (no position before it scores it)
        first = len(rows[r][0])
        inside_first = sum(log_probs[j - 1, t_ids[j]].item() for j in range(1, len(t_ids))
                           if sum(len(teacher.pieces[i]) for i in t_ids[:j + 1]) <= first)
        assert span[r].sum().item() == pytest.approx(total - inside_first, abs=1e-3)
        assert math.isfinite(span[r].sum().item())


def test_the_unmatched_mass_of_a_large_vocabulary_adds_up_to_one_with_the_matched(student_vocab, teacher):
    """A 262,144-wide teacher (Gemma 3's vocabulary): the unmatched column sums nearly all of it.
    Summed in float32 it missed 1 by up to 6.3e-4; it must equal a float64 reference."""
    rows = list(HARD_ROWS.values())
    ids, mask, texts, aligned = _align_rows(rows, student_vocab, teacher)
    width = 262_144
    logits = torch.randn(*aligned.teacher_ids.shape, width, generator=torch.Generator().manual_seed(2)) * 3
    request = OutputRequest.resolve(output_spec([ProjectedNext()]), facts_of(teacher, width))
    request = request.aligned(len(student_vocab), aligned.match.size)
    projected, mass = request.derive(BatchOutputs(logits), _Batch(aligned))
    column = torch.from_numpy(aligned.match.teacher_column)
    checked = 0
    for r in range(len(rows)):
        for t in mask[r].nonzero()[:, 0].tolist():
            context = int(aligned.context[r, t])
            if context < 0:
                continue
            probs = torch.softmax(logits[r, context].double(), -1)
            unmatched = probs[len(column):].sum() + probs[:len(column)][column == aligned.match.size].sum()
            assert mass[r, t].item() == pytest.approx(unmatched.item(), abs=1e-6)
            assert projected[r, t].double().sum().item() + mass[r, t].item() == pytest.approx(1.0, abs=1e-6)
            checked += 1
    assert checked > 5

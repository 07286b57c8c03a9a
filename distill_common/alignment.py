"""Two tokenizations of one text, aligned on its bytes: what a student with another tokenizer needs.

A student whose tokenizer differs from the teacher's cannot use the teacher's logits as they
come: index i means another string on each side. Both sides agree on the text, though, so the
alignment runs on the teacher, once per batch, and the student receives tensors shaped to its
own tokens (distill_common/outputs/cross_tokenizer.py: `SpanLogprobs`, `ProjectedNext`, `SortedProbs`).

The parts:

- `vocabulary_bytes`: the bytes each id of a tokenizer stands for (byte-level BPE maps
  its symbols back through GPT-2's byte table; SentencePiece writes "▁" for a space and
  "<0xAB>" for a raw byte); special tokens stand for no text (b"").
- `StudentVocabulary`: the student's, sent once at join (JoinRequest.student_vocabulary),
  with the limits a teacher puts on it.
- `VocabularyMatch`: which student ids spell exactly the bytes of some teacher id, computed
  once per session at join.
- `TeacherTokenizer`: the teacher's tokenizer, encoding raw bytes (a student row may begin
  or end inside a multi-byte character: those bytes take the teacher's single-byte tokens) the
  way it encodes a text: after the special tokens its convention puts first (its <bos>) and,
  for a SentencePiece tokenizer that prepends a space, with that space.
- `align_batch`: for one batch, the student's ids and the text each row spells, checked
  against each other, re-tokenized with the teacher's tokenizer and aligned: the
  `AlignedBatch` the forward runs on and the output kinds read.

Conventions (the ones the outputs document). Student position t of a row is about its next
token, as a language model's logits at t are: the text before is the bytes of tokens 0..t.
A *boundary* is a byte offset where a token starts or ends. The teacher's log-probability of
a student token's bytes is the chain rule over the teacher tokens of the teacher's own
tokenization of the whole row; a teacher token that straddles a student token's edge counts,
whole, for the student token that holds its last byte, so the values of a row sum to the
teacher's log-likelihood of the row's text (less the teacher tokens inside the student's first
token, which no student position predicts). The teacher's next-token distribution is defined
where the text before a student position ends on a teacher boundary; elsewhere no teacher
position has seen exactly that text.

The teacher reads each row the way its tokenizer encodes a text, as it was trained to: after
its <bos> where its convention has one (Llama, Gemma; Qwen has none), which stands for no text,
so every teacher token of the text has a context, the first one included; and with the space a
SentencePiece tokenizer puts before a text (Llama-2, Mistral-v0.1), which belongs to no student
token, so the teacher token holding it is never exact. A row that begins inside a character
gets no such space.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class AlignmentError(ValueError):
    """The two tokenizations cannot be aligned (a row whose text and ids disagree, a vocabulary
    over the limit); the message names the row or the field and says what to change."""


class BatchTooLarge(AlignmentError):
    """A batch whose rows, in the teacher's tokens, take more than the tokens a batch may have."""


# ---- the bytes each id stands for -------------------------------------------------------

def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's table from byte-level BPE symbols back to bytes (the inverse of `bytes_to_unicode`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


_BYTE_DECODER = _gpt2_byte_decoder()
_SENTENCEPIECE_SPACE = "▁"


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer, or the tokenizer itself."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise AlignmentError(f"{type(tokenizer).__name__} is not a fast tokenizer: cross-tokenizer distillation reads "
                             "the tokenizer's pieces from its tokenizers.Tokenizer (use a *TokenizerFast)")
    return backend


def _decoder_types(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    types = {decoder.get("type", "")}
    for child in decoder.get("decoders", []) or []:
        types |= _decoder_types(child)
    return types


def vocabulary_bytes(tokenizer) -> list[bytes]:
    """The bytes each id stands for, by id; b"" for special tokens (they stand for no text).

    Byte-level BPE (a ByteLevel decoder) and SentencePiece-style vocabularies (a Metaspace or
    "▁"-replacing decoder, with "<0xAB>" byte-fallback pieces) are read; any other decoder is
    refused, since the bytes of a piece cannot then be told from its string.
    """
    backend = _backend(tokenizer)
    decoder_types = _decoder_types(json.loads(backend.to_str()).get("decoder"))
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    pieces = [""] * size
    for piece, index in vocab.items():
        pieces[index] = piece
    if "ByteLevel" in decoder_types:
        return [b"" if piece in special or not piece else _byte_level(piece) for piece in pieces]
    if decoder_types & {"Metaspace", "Replace", "ByteFallback"}:
        return [b"" if piece in special or not piece else _sentencepiece(piece) for piece in pieces]
    raise AlignmentError(f"cannot tell the bytes of this tokenizer's pieces (decoder {sorted(decoder_types)}): "
                         "byte-level BPE and SentencePiece-style tokenizers are supported")


def _byte_level(piece: str) -> bytes:
    try:
        return bytes(_BYTE_DECODER[char] for char in piece)
    except KeyError:  # an added (non-special) token kept as plain text
        return piece.encode("utf-8")


def _sentencepiece(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")


# ---- the student's vocabulary, sent at join ---------------------------------------------

# A piece longer than this is no token of a real vocabulary (the longest in Llama-3's are 128 bytes).
MAX_PIECE_BYTES = 1024
# The bytes of a vocabulary's pieces, on average per entry, that a Join may carry (byte-level and
# SentencePiece vocabularies of 32k-256k entries average 5-9 bytes a piece).
VOCABULARY_BYTES_PER_ENTRY = 12


@dataclass(frozen=True)
class StudentVocabulary:
    """The bytes each student id stands for, by id (b"": a special token, no text)."""

    pieces: tuple[bytes, ...]

    @classmethod
    def of(cls, tokenizer) -> "StudentVocabulary":
        return cls(tuple(vocabulary_bytes(tokenizer)))

    def to_proto(self, message) -> None:
        """Writes `message` (a StudentVocabulary proto): the pieces back to back, and their lengths."""
        message.token_bytes = b"".join(self.pieces)
        message.token_lengths.extend(len(piece) for piece in self.pieces)

    @staticmethod
    def check_size(message, max_entries: int) -> None:
        """The limits a vocabulary's size is held to, read off the message without building
        anything (the entries' count and the bytes of their pieces): AlignmentError naming the
        limit when over it."""
        entries = len(message.token_lengths)
        if not entries:
            raise AlignmentError("student_vocabulary is empty: send the bytes of every id of the student's tokenizer "
                                 "(distill_common.alignment.StudentVocabulary.of(tokenizer))")
        if entries > max_entries:
            raise AlignmentError(f"student_vocabulary has {entries} entries, more than the teacher's "
                                 f"--max-student-vocab {max_entries}: start the teacher with a larger one")
        if len(message.token_bytes) > VOCABULARY_BYTES_PER_ENTRY * max_entries:
            raise AlignmentError(f"student_vocabulary holds {len(message.token_bytes)} bytes of pieces, more than "
                                 f"{VOCABULARY_BYTES_PER_ENTRY} x --max-student-vocab {max_entries}: start the teacher "
                                 "with a larger --max-student-vocab")

    @classmethod
    def from_proto(cls, message, max_entries: int) -> "StudentVocabulary":
        """The vocabulary a Join sent, checked: AlignmentError naming the limit when over it."""
        cls.check_size(message, max_entries)
        lengths = np.asarray(message.token_lengths, dtype=np.int64)
        data = message.token_bytes
        if int(lengths.max()) > MAX_PIECE_BYTES:
            raise AlignmentError(f"student_vocabulary has a piece of {int(lengths.max())} bytes (id "
                                 f"{int(lengths.argmax())}); pieces are at most {MAX_PIECE_BYTES} bytes")
        if int(lengths.sum()) != len(data):
            raise AlignmentError(f"student_vocabulary.token_lengths add up to {int(lengths.sum())} bytes but "
                                 f"token_bytes holds {len(data)}: send each piece's length, in id order")
        ends = np.cumsum(lengths)
        return cls(tuple(data[end - length:end] for end, length in zip(ends.tolist(), lengths.tolist())))

    def __len__(self) -> int:
        return len(self.pieces)


@dataclass(frozen=True, eq=False)
class VocabularyMatch:
    """Which student id each teacher id's probability goes to.

    `student_ids` [M], ascending: column j of a projected distribution is student id
    student_ids[j]. `teacher_column` [V_teacher]: the column each teacher id adds to, M for
    none (its probability is unmatched mass). Where several teacher ids go to one student id
    their probabilities add up; where several student ids spell the same bytes the lowest
    stands for them (the others get nothing), so no probability is counted twice. Pieces of no
    text (special tokens) never match.

    Exact (`build`, GOLD's rule): a teacher id goes to the student id that spells the same
    bytes. By prefix (`build(..., by_prefix=True)`): to the student id whose piece is the longest
    prefix of the teacher's, the token a student would most likely start the same text with; it
    keeps the mass of teacher tokens longer than any student token (a teacher with the larger
    vocabulary) instead of leaving it unmatched, and is exact where the pieces are equal.
    """

    student_ids: np.ndarray
    teacher_column: np.ndarray

    @classmethod
    def build(cls, student: Sequence[bytes], teacher: Sequence[bytes], by_prefix: bool = False) -> "VocabularyMatch":
        first_student: dict[bytes, int] = {}
        for index, piece in enumerate(student):
            if piece and piece not in first_student:
                first_student[piece] = index
        longest = max(map(len, first_student), default=0)
        target = []  # the student id each teacher id goes to, -1 for none
        for piece in teacher:
            if not by_prefix:
                target.append(first_student.get(piece, -1) if piece else -1)
                continue
            found = -1
            for length in range(min(len(piece), longest), 0, -1):
                found = first_student.get(piece[:length], -1)
                if found >= 0:
                    break
            target.append(found)
        student_ids = np.array(sorted({t for t in target if t >= 0}), dtype=np.int64)
        column_of = {index: column for column, index in enumerate(student_ids.tolist())}
        teacher_column = np.array([column_of.get(t, len(student_ids)) for t in target], dtype=np.int64)
        return cls(student_ids, teacher_column)

    @property
    def size(self) -> int:
        return len(self.student_ids)


# ---- the teacher's tokenizer ---------------------------------------------------------------

# The special tokens a tokenizer may put before a text (its <bos>; Llama-3's <|begin_of_text|>):
# more than this is no causal LM's convention.
MAX_LEAD_TOKENS = 4


def _without_prefix_space(config: dict) -> dict:
    """A tokenizer's JSON with the space it puts before a text taken out (a SentencePiece
    dummy prefix: Metaspace's prepend_scheme, a Prepend("▁") normalizer; ByteLevel's
    add_prefix_space): how it encodes text that continues a row rather than starts it."""

    def normalizer(node):
        if not node:
            return node
        if node.get("type") == "Prepend":
            return None
        if node.get("type") == "Sequence":
            kept = [n for n in (normalizer(child) for child in node.get("normalizers", [])) if n]
            return {**node, "normalizers": kept}
        return node

    def pre_tokenizer(node):
        if not node:
            return node
        if node.get("type") == "Sequence":
            return {**node, "pretokenizers": [pre_tokenizer(child) for child in node.get("pretokenizers", [])]}
        if node.get("type") == "Metaspace":
            node = {**node, "prepend_scheme": "never"}
        if "add_prefix_space" in node:
            node = {**node, "add_prefix_space": False}
        return node

    return {**config, "normalizer": normalizer(config.get("normalizer")),
            "pre_tokenizer": pre_tokenizer(config.get("pre_tokenizer"))}


def leading_special_ids(tokenizer) -> list[int]:
    """The ids a tokenizer's own convention puts before a text (`tokenizer(text)` against
    `tokenizer(text, add_special_tokens=False)`): its <bos> (Llama, Gemma), or nothing (GPT-2,
    Qwen). A transformers tokenizer or a `tokenizers.Tokenizer`."""
    probe = "a"
    if callable(tokenizer):  # a transformers tokenizer: its call is the convention its users see
        with_special = list(tokenizer(probe)["input_ids"])
        plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    else:
        backend = _backend(tokenizer)
        with_special, plain = backend.encode(probe).ids, backend.encode(probe, add_special_tokens=False).ids
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            if start > MAX_LEAD_TOKENS:
                raise AlignmentError(f"the teacher's tokenizer puts {start} special tokens before a text, more than "
                                     f"{MAX_LEAD_TOKENS}: not a causal language model's convention")
            return with_special[:start]
    return []


@dataclass(frozen=True)
class TeacherRow:
    """A row's text in the teacher's tokens, the way the teacher's tokenizer encodes a text.

    `ids`: the forward's input: `lead` special tokens (the tokenizer's <bos>, which stand for no
    text), then tokens that spell `prefix` bytes the tokenizer adds before a text (a
    SentencePiece dummy-prefix space) followed by the row's text exactly."""

    ids: list[int]
    lead: int
    prefix: int


class TeacherTokenizer:
    """The teacher's tokenizer, encoding a row's bytes into ids whose pieces spell them exactly,
    with what the tokenizer's convention puts before a text (`encode`)."""

    def __init__(self, tokenizer):
        config = json.loads(_backend(tokenizer).to_str())
        backend_type = type(_backend(tokenizer))
        # Copies of its own: set once, shared by the threads that encode (the Rust tokenizer is thread-safe).
        # `backend` starts a row; `continuing` encodes text after a byte the row cut a character at.
        self.backend = backend_type.from_str(json.dumps(config))
        self.continuing = backend_type.from_str(json.dumps(_without_prefix_space(config)))
        for backend in (self.backend, self.continuing):
            # Text that reads like a special token ("<|eos|>" written out) stays text.
            if hasattr(backend, "encode_special_tokens"):
                backend.encode_special_tokens = True
        self.pieces = vocabulary_bytes(tokenizer)
        self.lead = leading_special_ids(tokenizer)
        probe = b"".join(self.pieces[i] for i in self.backend.encode("a", add_special_tokens=False).ids)
        # The bytes the tokenizer puts before a text that does not begin with them (b" " for a
        # SentencePiece that prepends a space), b"" for most.
        self.prefix = probe[:-1] if probe.endswith(b"a") else b""
        self.byte_ids = {piece[0]: index for index, piece in reversed(list(enumerate(self.pieces)))
                         if len(piece) == 1}
        self.longest_piece_bytes = max(map(len, self.pieces), default=1) or 1

    def fewest_tokens(self, text: bytes) -> int:
        """A lower bound on the ids `encode(text)` makes, known without encoding: no piece is
        longer than the longest."""
        return len(self.lead) + -(-len(text) // self.longest_piece_bytes)

    def encode(self, text: bytes, row: int = 0) -> TeacherRow:
        """`text` in the teacher's tokens, as its tokenizer encodes a text: its lead (<bos>),
        then valid UTF-8 runs through the tokenizer (the first one with the space a SentencePiece
        tokenizer prepends, the others without), bytes of a character cut at the row's edge as
        single-byte tokens. AlignmentError, naming `row`, when the ids do not spell the text (a
        tokenizer that normalizes, a byte it has no token for)."""
        ids: list[int] = []
        start = 0
        while start < len(text):
            try:
                chunk = text[start:].decode("utf-8")
                end = len(text)
            except UnicodeDecodeError as e:
                chunk, end = text[start:start + e.start].decode("utf-8"), start + e.start
            if chunk:
                backend = self.backend if start == 0 else self.continuing
                ids.extend(backend.encode(chunk, add_special_tokens=False).ids)
            if end < len(text):  # one byte that starts no valid character here
                byte = text[end]
                if byte not in self.byte_ids:
                    raise AlignmentError(f"row {row}: byte 0x{byte:02x} at offset {end} is no valid UTF-8 there "
                                         "and the teacher's vocabulary has no token for it")
                ids.append(self.byte_ids[byte])
                end += 1
            start = end
        spelled = b"".join(self.pieces[i] for i in ids)
        prefix = len(self.prefix) if self.prefix and spelled == self.prefix + text else 0
        if spelled[prefix:] != text:
            at = next((i for i, (a, b) in enumerate(zip(spelled, text)) if a != b), min(len(spelled), len(text)))
            raise AlignmentError(f"row {row}: the teacher's tokenizer does not reproduce the row's text (they differ "
                                 f"from byte {at}): a tokenizer that normalizes text (lower-cases it, rewrites "
                                 "its characters) cannot be aligned by bytes")
        return TeacherRow(self.lead + ids, len(self.lead), prefix)


# ---- one batch ------------------------------------------------------------------------------

@dataclass
class AlignedBatch:
    """One batch of student rows, re-tokenized by the teacher and aligned.

    `teacher_ids`, `teacher_mask` [B, T]: the forward's input, rows right-padded.
    `span_owner` [B, T] int64: for teacher token j (its log-probability read from the logits at
    j - 1), the student position whose span value it adds to; S (one past the row) for none:
    teacher token 0 (no context), the lead (<bos>) and a prefix space alone, tokens inside the
    student's first token, and padding.
    `span_exact` [B, S] bool: the student's next token starts and ends on teacher boundaries and
    spells some text, so its value is exactly the teacher's probability of those bytes.
    `context` [B, S] int64: the teacher position whose text before is exactly the student
    position's (its tokens 0..t), -1 where none is (padding, a text that ends inside a
    teacher token, an empty text the teacher has no position for: it has one after its <bos>).
    `match`: the session's VocabularyMatch (what a projected distribution's columns are).
    """

    teacher_ids: torch.Tensor
    teacher_mask: torch.Tensor
    span_owner: torch.Tensor
    span_exact: torch.Tensor
    context: torch.Tensor
    match: VocabularyMatch

    @property
    def student_shape(self) -> tuple[int, int]:
        return tuple(self.context.shape)


def row_texts(ids: torch.Tensor, mask: torch.Tensor, vocabulary: StudentVocabulary) -> list[bytes]:
    """The bytes each row's real tokens spell (the text a student sends with its batch)."""
    pieces = vocabulary.pieces
    real = ids[mask.bool()]
    if len(real) and not 0 <= int(real.min()) <= int(real.max()) < len(pieces):
        raise AlignmentError(f"ids must lie in [0, {len(pieces)}) (the student's vocabulary), got values in "
                             f"[{int(real.min())}, {int(real.max())}]")
    return [b"".join(pieces[i] for i, real in zip(row_ids, row_mask) if real)
            for row_ids, row_mask in zip(ids.tolist(), mask.tolist())]


def align_batch(ids: torch.Tensor, mask: torch.Tensor, texts: Sequence[bytes], vocabulary: StudentVocabulary,
                teacher: TeacherTokenizer, match: VocabularyMatch, max_teacher_tokens: int,
                max_batch_tokens: int = 0) -> AlignedBatch:
    """Checks each row's ids against its text, re-tokenizes the text with the teacher's
    tokenizer and aligns the two; AlignmentError naming the row where they disagree, or where
    a row needs more than `max_teacher_tokens` teacher tokens; BatchTooLarge as soon as the
    rows, right-padded, must take more than `max_batch_tokens` (0: no bound) teacher tokens."""
    rows, seq = ids.shape
    if len(texts) != rows:
        raise AlignmentError(f"student_text has {len(texts)} rows, input_ids {rows}: send one text per row")
    pieces = vocabulary.pieces
    # Every row is checked before any is re-tokenized (the costly part), and so is a lower bound
    # on its length in the teacher's tokens: a batch refused for either costs no encoding.
    checked = []
    for row, (row_ids, row_mask, text) in enumerate(zip(ids.tolist(), mask.tolist(), texts)):
        positions = [t for t, real in enumerate(row_mask) if real]
        if any(row_ids[t] >= len(pieces) for t in positions):
            bad = next(row_ids[t] for t in positions if row_ids[t] >= len(pieces))
            raise AlignmentError(f"row {row}: id {bad} is outside the student vocabulary sent at join "
                                 f"({len(pieces)} entries)")
        lengths = np.array([len(pieces[row_ids[t]]) for t in positions], dtype=np.int64)
        ends = np.cumsum(lengths)
        spelled = b"".join(pieces[row_ids[t]] for t in positions)
        if spelled != text:
            at = next((i for i, (a, b) in enumerate(zip(spelled, text)) if a != b), min(len(spelled), len(text)))
            token = int(np.searchsorted(ends, at, side="right")) if len(ends) else 0
            raise AlignmentError(
                f"row {row}: its text and its ids disagree from byte {at} (the ids spell {len(spelled)} bytes, the "
                f"text has {len(text)}; near the row's token {min(token, len(positions) - 1)}): send the bytes "
                "the row's ids spell (distill_common.alignment.row_texts) and the vocabulary of the tokenizer that "
                "made them")
        if teacher.fewest_tokens(text) > max_teacher_tokens:
            raise AlignmentError(f"row {row}: its {len(text)} bytes of text make at least "
                                 f"{teacher.fewest_tokens(text)} tokens in the teacher's tokenizer, more than the "
                                 f"teacher's --max-seq-len {max_teacher_tokens}: send shorter rows")
        checked.append((positions, lengths, ends))
    # The widest row bounds the batch: known after each row from the rows encoded and the others'
    # lower bounds, so that a batch too large is refused once it is known, not once all of it is encoded.
    fewest = [teacher.fewest_tokens(text) for text in texts]
    widest_after = [max(fewest[row + 1:], default=0) for row in range(rows)]
    width = 0
    teacher_rows, owners, exact, context = [], [], np.zeros((rows, seq), bool), np.full((rows, seq), -1, np.int64)
    for row, (text, (positions, lengths, ends)) in enumerate(zip(texts, checked)):
        if max_batch_tokens and rows * max(width, fewest[row], widest_after[row]) > max_batch_tokens:
            raise BatchTooLarge(f"its {rows} rows take at least {rows} x {max(width, fewest[row], widest_after[row])} "
                                f"tokens in the teacher's tokenizer (rows are padded to the longest), more than the "
                                f"teacher's --max-batch-tokens {max_batch_tokens}: send smaller batches")
        encoded = teacher.encode(text, row)
        teacher_ids = encoded.ids
        if len(teacher_ids) > max_teacher_tokens:
            raise AlignmentError(f"row {row}: the teacher's tokenizer makes {len(teacher_ids)} tokens of its text, "
                                 f"more than the teacher's --max-seq-len {max_teacher_tokens}: send shorter rows")
        width = max(width, len(teacher_ids))
        if max_batch_tokens and rows * max(width, widest_after[row]) > max_batch_tokens:
            raise BatchTooLarge(f"its {rows} rows take at least {rows} x {max(width, widest_after[row])} tokens in the "
                                f"teacher's tokenizer (rows are padded to the longest), more than the teacher's "
                                f"--max-batch-tokens {max_batch_tokens}: send smaller batches")
        # Byte offsets in the row's text: the lead (<bos>) spells nothing and ends before the text,
        # as do the prefix bytes the tokenizer put before it.
        teacher_lengths = np.array([0] * encoded.lead + [len(teacher.pieces[i]) for i in teacher_ids[encoded.lead:]],
                                   dtype=np.int64)
        teacher_ends = np.cumsum(teacher_lengths) - encoded.prefix
        teacher_starts = teacher_ends - teacher_lengths
        starts = ends - lengths
        # The student token holding each teacher token's last byte; the position before it scores it.
        # Tokens that end before the text (the lead, a prefix space alone) are held by none.
        holder = np.searchsorted(ends, teacher_ends - 1, side="right")
        owner = np.where(holder >= 1, np.asarray(positions + [seq], dtype=np.int64)[np.maximum(holder - 1, 0)], seq)
        owner[0:1] = seq  # teacher token 0 has no context to be scored from
        owners.append(owner)
        teacher_rows.append(teacher_ids)
        boundaries_start, boundaries_end = set(teacher_starts.tolist()), set(teacher_ends.tolist())
        for k in range(len(positions) - 1):
            nxt = k + 1
            exact[row, positions[k]] = (lengths[nxt] > 0 and int(starts[nxt]) in boundaries_start
                                        and int(ends[nxt]) in boundaries_end
                                        and not (len(teacher_ids) and holder[0] == nxt))
        # The last teacher token ending where each student token ends: its position has seen the
        # same text (after the lead, a row's empty start: where the teacher's lead ends it).
        where = np.searchsorted(teacher_ends, ends, side="right") - 1
        for k, t in enumerate(positions[:-1]):  # the last position has no next token to predict
            j = int(where[k])
            if j >= 0 and teacher_ends[j] == ends[k]:
                context[row, t] = j
    width = max(1, max(len(r) for r in teacher_rows))
    teacher_ids = torch.zeros(rows, width, dtype=torch.int64)
    teacher_mask = torch.zeros(rows, width, dtype=torch.int64)
    span_owner = torch.full((rows, width), seq, dtype=torch.int64)
    for row, (row_ids, owner) in enumerate(zip(teacher_rows, owners)):
        teacher_ids[row, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.int64)
        teacher_mask[row, :len(row_ids)] = 1
        span_owner[row, :len(row_ids)] = torch.from_numpy(owner)
        if not row_ids:  # a row whose real tokens spell no text: one pad token keeps the forward's row valid
            teacher_mask[row, 0] = 1
    return AlignedBatch(teacher_ids, teacher_mask, span_owner, torch.from_numpy(exact), torch.from_numpy(context),
                        match)

"""Cross-tokenizer distillation from teachers whose tokenizers are laid out like the real ones,
each kind and loss against a reference written here the straightforward way.

The layouts, built locally (no hub): a byte-level BPE without <bos> whose embedding has more
rows than its tokenizer has entries (Qwen); SentencePiece with byte fallback and <bos> that
prepends a space through a Prepend normalizer (Llama-2) or its Metaspace pre-tokenizer
(Mistral-v0.1); SentencePiece with byte fallback and <bos>, no prefix space (Gemma). The
student is a byte-level BPE of other merges.

The references read the teacher's tokens from its own tokenizer's call (`encode(text)`, special
tokens included: the convention the teacher was trained with), run the teacher model on them
alone, and walk byte offsets in loops; nothing here calls the alignment the server runs except
to get what it served.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from distill_common.alignment import StudentVocabulary, TeacherTokenizer, VocabularyMatch, align_batch, row_texts
from distill_common.outputs import BatchOutputs, OutputRequest, ProjectedNext, SortedProbs, SpanLogprobs, output_spec
from student_trainer.losses import gold_loss, uld_loss
from tests.test_alignment import STUDENT_MERGES, TEACHER_MERGES, _Batch, byte_level_tokenizer, facts_of, \
    reference_match

_CORPUS = ["hello world 1234 the world of words", "def f(x):\n    return x + 1", "the cat sat on the mat"] * 4


def sentencepiece_tokenizer(layout: str) -> Tokenizer:
    """A SentencePiece-style BPE as Hugging Face converts them: <unk> <s> </s>, the 256
    "<0xAB>" byte-fallback pieces, then pieces trained on a few lines; `layout` says how it puts
    a space before a text: "llama2" (a Prepend("▁") normalizer), "mistral" (Metaspace,
    prepend_scheme "first"), "gemma" (none). All three put <s> first."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Replace(" ", "▁")
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    base.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=120, show_progress=False, special_tokens=[]))
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if layout == "llama2":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif layout == "mistral":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if layout != "gemma" else []))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    return tokenizer


def _teacher(layout: str):
    """(the tokenizer as a teacher's directory would load it, its tokenizers.Tokenizer, the
    logits' width, the bytes the tokenizer puts before a text, whether it puts <bos> first)."""
    from transformers import PreTrainedTokenizerFast

    if layout == "qwen":
        raw = byte_level_tokenizer(TEACHER_MERGES)
        return raw, raw, raw.get_vocab_size() + 64, b"", False
    raw = sentencepiece_tokenizer(layout)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return wrapped, raw, raw.get_vocab_size() + (16 if layout == "gemma" else 0), \
        b" " if layout != "gemma" else b"", True


LAYOUTS = ("qwen", "llama2", "mistral", "gemma")

# Rows of the student (pieces of its vocabulary, or a text it encodes). b"" is its <|eos|>, a token of no text.
ROWS = [
    "hello world 1234",
    " the cat sat on the mat",  # begins with a space: a prefix-space tokenizer adds none (Metaspace) or one more
    "café 😀 naïve\n    return x",  # characters the SentencePiece teachers spell in byte-fallback pieces
    [b""] + [b"hello", b" wo", b"rld"],  # a row after a document's end: every teacher token is predicted
    [b"\xa9", b" w", b"a\xc3"],  # cut inside characters at both ends: no prefix space, byte pieces
    "x  =  [12, 345]",
]


def _student_rows(student: Tokenizer, vocabulary: StudentVocabulary):
    index = {}
    for i, piece in enumerate(vocabulary.pieces):
        index.setdefault(piece, i)
    rows = [student.encode(row, add_special_tokens=False).ids if isinstance(row, str) else [index[p] for p in row]
            for row in ROWS]
    width = max(map(len, rows)) + 1
    ids = torch.full((len(rows), width), index[b""], dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    return ids, mask


def _model(width: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=width, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init: distributions far from uniform
        model.lm_head.weight.mul_(40)
    return model


# ---- the references ---------------------------------------------------------------------------

def _offsets(pieces: list[bytes]) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for piece in pieces:
        spans.append((offset, offset + len(piece)))
        offset += len(piece)
    return spans


def reference_row(student_pieces, teacher_pieces, prefix: int, token_logprobs):
    """Per student position k (the last excepted): the span value and exactness of token k + 1,
    and the teacher position whose text before is exactly tokens 0..k's. The teacher's offsets
    run over the prefix bytes and the text; the student's are shifted by the prefix. A teacher
    token spells its piece; one of no bytes (<bos>) has no last byte and holds no text."""
    student = [(a + prefix, b + prefix) for a, b in _offsets(student_pieces)]
    teacher = _offsets(teacher_pieces)
    values, exact, context = [], [], []
    for k in range(len(student_pieces) - 1):
        a, b = student[k + 1]
        held = [j for j, (s, e) in enumerate(teacher) if e > s and a <= e - 1 < b]
        values.append(sum(token_logprobs[j] for j in held if j >= 1))
        starts = {s for s, e in teacher if e > s}
        ends = {e for s, e in teacher if e > s}
        exact.append(b > a and a in starts and b in ends and 0 not in held)
        seen = student[k][1]  # the text before, through token k
        candidates = [j for j, (s, e) in enumerate(teacher) if e == seen]
        context.append(max(candidates) if candidates else -1)
    return values, exact, context


def _reference_teacher_ids(raw: Tokenizer, text: bytes, served: list[int], pieces) -> list[int]:
    """The teacher's ids of a row as its own tokenizer's call makes them (with <bos>)."""
    try:
        return raw.encode(text.decode("utf-8")).ids
    except UnicodeDecodeError:  # a row cut inside a character: no call encodes it; its bytes must be spelled
        assert b"".join(pieces[i] for i in served).endswith(text)
        return served


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("by_prefix", [False, True])
def test_every_kind_and_loss_equals_the_reference(layout, by_prefix):
    tokenizer, raw, width, prefix_bytes, has_bos = _teacher(layout)
    teacher = TeacherTokenizer(tokenizer)
    assert teacher.prefix == prefix_bytes and bool(teacher.lead) == has_bos
    student = byte_level_tokenizer(STUDENT_MERGES, special=("<|pad|>", "<|eos|>"))
    vocabulary = StudentVocabulary.of(student)
    ids, mask = _student_rows(student, vocabulary)
    texts = row_texts(ids, mask, vocabulary)
    match = VocabularyMatch.build(vocabulary.pieces, teacher.pieces, by_prefix=by_prefix)
    aligned = align_batch(ids, mask, texts, vocabulary, teacher, match, max_teacher_tokens=128)
    model = _model(width)
    with torch.no_grad():
        logits = model(input_ids=aligned.teacher_ids, attention_mask=aligned.teacher_mask).logits
    rest_k, sorted_k = 3, 5
    request = OutputRequest.resolve(output_spec([SpanLogprobs(), ProjectedNext(rest_k, by_prefix), SortedProbs(sorted_k)]),
                                    facts_of(teacher, width)).aligned(len(vocabulary), match.size)
    span, exact, projected, mass, rest, top = request.derive(BatchOutputs(logits), _Batch(aligned))

    matched, sources = reference_match(list(vocabulary.pieces), teacher.pieces, by_prefix)
    student_logits = torch.randn(*ids.shape, len(vocabulary.pieces), generator=torch.Generator().manual_seed(3)) * 2
    to_column = torch.zeros(width, len(matched), dtype=torch.float64)  # teacher id -> the column it adds to
    for column, u in enumerate(matched):
        to_column[sources[u], column] = 1.0
    sourced = {v for s in sources.values() for v in s}
    unmatched = [v for v in range(width) if v not in sourced]
    unmatched_students = [v for v in range(len(vocabulary.pieces)) if v not in set(matched)]
    gold_terms, gold_rest_terms, uld_terms = [], [], []
    for r in range(len(ROWS)):
        positions = mask[r].nonzero()[:, 0].tolist()
        student_pieces = [vocabulary.pieces[i] for i in ids[r, positions].tolist()]
        served = aligned.teacher_ids[r][aligned.teacher_mask[r].bool()].tolist()
        reference_ids = _reference_teacher_ids(raw, texts[r], served, teacher.pieces)
        assert served == reference_ids, (layout, ROWS[r])
        assert (reference_ids[0] == raw.token_to_id("<s>")) == has_bos
        teacher_pieces = [teacher.pieces[i] if j >= has_bos else b"" for j, i in enumerate(reference_ids)]
        prefix = len(b"".join(teacher_pieces)) - len(texts[r])
        assert b"".join(teacher_pieces)[prefix:] == texts[r] and prefix in (0, len(prefix_bytes))
        with torch.no_grad():  # the teacher's own forward on its own tokens of this row alone
            own = torch.log_softmax(model(input_ids=torch.tensor([reference_ids])).logits[0].double(), -1)
        token_logprobs = [0.0] + [own[j - 1, reference_ids[j]].item() for j in range(1, len(reference_ids))]
        values, want_exact, context = reference_row(student_pieces, teacher_pieces, prefix, token_logprobs)
        for k, t in enumerate(positions[:-1]):
            assert span[r, t].item() == pytest.approx(values[k], abs=2e-4), (layout, r, k)
            assert bool(exact[r, t]) == want_exact[k], (layout, r, k)
            if context[k] < 0:
                assert projected[r, t].abs().sum() == mass[r, t] == top[r, t].abs().sum() == rest[r, t].abs().sum() == 0
                continue
            probs = own[context[k]].exp()
            p = (probs @ to_column).tolist()
            assert projected[r, t].tolist() == pytest.approx(p, abs=1e-5)
            assert mass[r, t].item() == pytest.approx(probs[unmatched].sum().item(), abs=1e-5)
            want_rest = (sorted(probs[unmatched].tolist(), reverse=True) + [0.0] * rest_k)[:rest_k]
            assert rest[r, t].tolist() == pytest.approx(want_rest, abs=1e-5)
            want_top = sorted(probs.tolist(), reverse=True)[:sorted_k]
            assert top[r, t].tolist() == pytest.approx(want_top, abs=1e-5)
            # The losses, term by term: GOLD's KL on the matched ids plus the rest (its mass, or its sorted top-k)
            q = torch.softmax(student_logits[r, t].double(), -1)
            log_q = q.log().tolist()
            kl = sum(p_j * (math.log(p_j) - log_q[u]) for p_j, u in zip(p, matched) if p_j > 0)
            q_rest = q[unmatched_students].sort(descending=True).values.tolist()
            gold_terms.append(kl + abs(mass[r, t].item() - (1 - sum(math.exp(log_q[u]) for u in matched))))
            gold_rest_terms.append(kl + sum(abs(a - b) for a, b in zip(want_rest, q_rest[:rest_k])))
            uld_terms.append(sum(abs(a - b) for a, b in zip(want_top, sorted(q.tolist(), reverse=True)[:sorted_k])))
        # A row after a document's end: its spans add up to the teacher's log-likelihood of the
        # text, as its own forward gives it (with <bos>: every token; without: the first has no context).
        if ROWS[r][0] == b"":
            assert sum(values) == pytest.approx(sum(token_logprobs), abs=1e-9)
            assert span[r].sum().item() == pytest.approx(sum(token_logprobs), abs=5e-4)
    matched_ids = torch.tensor(matched)
    assert len(gold_terms) > 10
    assert gold_loss(student_logits, projected, mass, matched_ids, mask=mask).item() == pytest.approx(
        sum(gold_terms) / len(gold_terms), rel=1e-5)
    assert gold_loss(student_logits, projected, mass, matched_ids, rest, mask).item() == pytest.approx(
        sum(gold_rest_terms) / len(gold_rest_terms), rel=1e-5)
    assert uld_loss(student_logits, top, mask).item() == pytest.approx(sum(uld_terms) / len(uld_terms), rel=1e-5)


def test_a_prefix_space_teacher_takes_rows_that_do_not_begin_with_a_space():
    """Outside checks: `TeacherTokenizer(llama2_style).encode(b"hello world")` refused the row."""
    for layout in ("llama2", "mistral"):
        tokenizer, raw, *_ = _teacher(layout)
        teacher = TeacherTokenizer(tokenizer)
        row = teacher.encode(b"hello world")
        assert row.ids == raw.encode("hello world").ids and row.lead == 1 and row.prefix == 1
        assert b"".join(teacher.pieces[i] for i in row.ids) == b" hello world"
        # A row that begins with a space: Llama-2's normalizer adds one more, Mistral's Metaspace none.
        row = teacher.encode(b" hello")
        assert row.ids == raw.encode(" hello").ids and row.prefix == (1 if layout == "llama2" else 0)

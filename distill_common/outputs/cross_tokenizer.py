"""Kinds for a student with another tokenizer, shaped to the student's own tokens: the teacher's
log-probability of each student token's bytes, its next-token distribution projected onto the
student's vocabulary, and its largest probabilities sorted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from distill_common.outputs import logprobs
from distill_common.outputs.base import (BatchDataError, BatchOutputs, ForwardNeeds, Output, OutputSpecError,
                                         TeacherFacts, TeacherOutput, TensorSpec)
from distill_common.outputs.logprobs import _logprobs_at, _to_device
from distill_common.proto.teacher.v1 import teacher_pb2 as pb


# The batch's data these kinds read: the AlignedBatch the teacher made of the student's ids and text.
ALIGNMENT = "alignment"


class CrossTokenizerKind(Output):
    """A kind for a student with another tokenizer (OutputSpec.cross_tokenizer).

    The teacher re-tokenizes each row's text (SubmitRequest.student_text) and runs its forward on
    that; `derive` finds the alignment in `batch.data[ALIGNMENT]` (an `AlignedBatch`) and
    returns tensors shaped [B, S] to the student's tokens, whatever the teacher's tokens were.
    Every position is about the student's next token (distill_common/alignment.py says how
    the two tokenizations meet); padding and the last real position hold zeros.
    """

    cross_tokenizer: ClassVar[bool] = True
    batch_field: ClassVar[str] = "student_text"

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(logits=True)

    def write_batch(self, value, batch: int, seq: int, teacher: TeacherFacts) -> pb.RowTexts:
        if len(value) != batch or not all(isinstance(row, bytes) for row in value):
            raise ValueError(f"student_text must be {batch} bytes objects, one per row of input_ids (the bytes its "
                             "real tokens spell: distill_common.alignment.row_texts)")
        return pb.RowTexts(rows=value)

    def read_batch(self, message: pb.RowTexts, batch: int, seq: int, teacher: TeacherFacts) -> list[bytes]:
        if len(message.rows) != batch:
            raise BatchDataError(f"student_text has {len(message.rows)} rows, input_ids {batch}: send one text per row")
        return list(message.rows)


def _columns(teacher_column: np.ndarray, width: int, unmatched: int) -> np.ndarray:
    """The projection's column of each of the logits' `width` ids: a model's embedding often has
    more rows than its tokenizer has entries (Qwen's 151,936 against 151,665); those ids spell
    nothing, so their probability counts as unmatched."""
    if len(teacher_column) >= width:
        return teacher_column[:width]
    return np.concatenate([teacher_column, np.full(width - len(teacher_column), unmatched, dtype=np.int64)])


def _aligned_probs(logits: torch.Tensor, context: torch.Tensor, dtype: torch.dtype = torch.float32):
    """The positions whose context a teacher position ends exactly, and the teacher's next-token
    probabilities there in chunks of `dtype`: yields (rows, cols, probs [n, V]) over the valid positions."""
    rows, cols = (context >= 0).nonzero(as_tuple=True)
    vocab = logits.shape[-1]
    element = torch.finfo(dtype).bits // 8
    step = max(1, logprobs._LOGPROB_CHUNK_BYTES // (element * vocab))  # the one chunk size, set in logprobs.py
    for start in range(0, len(rows), step):
        r, c = rows[start:start + step], cols[start:start + step]
        yield r, c, torch.softmax(logits[r, context[r, c]].to(dtype), dim=-1)


@dataclass(frozen=True)
class SpanLogprobs(CrossTokenizerKind):
    """The teacher's log-probability of each student token's bytes given the text before:
    float32 [B, S] (position t: the token t + 1; the chain rule over the teacher tokens that end
    inside it) and uint8 [B, S], 1 where that value is exact (both of the token's edges are
    teacher boundaries). What GOLD and ALM compare span by span."""

    asked_as: ClassVar[str] = "cross_tokenizer.span_logprobs"

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "SpanLogprobs | None":
        return cls() if spec.HasField("cross_tokenizer") and spec.cross_tokenizer.span_logprobs else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.cross_tokenizer.span_logprobs = True

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq), torch.float32), TensorSpec((batch, seq), torch.uint8)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        aligned = batch.data[ALIGNMENT]
        logits = forward.logits
        rows, teacher_seq = logits.shape[:2]
        seq = aligned.student_shape[1]
        token_logprobs = torch.zeros(rows, teacher_seq, dtype=torch.float32, device=logits.device)
        if teacher_seq > 1:
            ids = _to_device(aligned.teacher_ids, logits.device)
            token_logprobs[:, 1:] = _logprobs_at(logits[:, :-1], ids[:, 1:, None], 1.0)[..., 0]
        owner = _to_device(aligned.span_owner, logits.device)
        values = torch.zeros(rows, seq + 1, dtype=torch.float32, device=logits.device)
        values.scatter_add_(1, owner, token_logprobs)
        exact = _to_device(aligned.span_exact, logits.device).to(torch.uint8)
        return [values[:, :seq].contiguous(), exact.contiguous()]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        values, exact = tensors
        return {"span_logprobs": values, "span_exact": exact.bool()}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.span_logprobs, out.span_exact.to(torch.uint8)]

    def __str__(self) -> str:
        return "span_logprobs"


def _check_sorted_k(name: str, k: int, teacher: TeacherFacts) -> None:
    if not 0 < k <= teacher.vocab_size:
        raise OutputSpecError(f"cross_tokenizer.{name} {k} must be between 1 and the teacher's vocabulary size "
                              f"{teacher.vocab_size} (0 asks for none)")
    if teacher.max_topk and k > teacher.max_topk:
        raise OutputSpecError(f"cross_tokenizer.{name} {k} exceeds the teacher's --max-topk {teacher.max_topk}: ask "
                              "for fewer, or start the teacher with a larger --max-topk")


@dataclass(frozen=True)
class ProjectedNext(CrossTokenizerKind):
    """The teacher's next-token distribution projected onto the student's vocabulary: float32
    [B, S, M], column j the probability of student id matched_student_ids[j] (exact byte
    matches, or with `by_prefix` longest-prefix ones: `alignment.VocabularyMatch`), float32
    [B, S] the unmatched mass, and with
    `rest_topk` the k largest unmatched probabilities, sorted. All zeros where no teacher
    position ends where the student's text does. M is the session's (`TeacherFacts.matched_entries`)."""

    rest_topk: int = 0
    by_prefix: bool = False  # the match (alignment.VocabularyMatch): by exact bytes, or by longest prefix
    asked_as: ClassVar[str] = "cross_tokenizer.projected"

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "ProjectedNext | None":
        if not spec.HasField("cross_tokenizer") or not spec.cross_tokenizer.projected:
            return None
        return cls(spec.cross_tokenizer.projected_rest_topk, spec.cross_tokenizer.projected_by_prefix)

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.cross_tokenizer.projected = True
        spec.cross_tokenizer.projected_rest_topk = self.rest_topk
        spec.cross_tokenizer.projected_by_prefix = self.by_prefix

    def check(self, teacher: TeacherFacts) -> None:
        if self.rest_topk:
            _check_sorted_k("projected_rest_topk", self.rest_topk, teacher)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        specs = [TensorSpec((batch, seq, teacher.matched_entries), torch.float32),
                 TensorSpec((batch, seq), torch.float32)]
        return specs + ([TensorSpec((batch, seq, self.rest_topk), torch.float32)] if self.rest_topk else [])

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        aligned = batch.data[ALIGNMENT]
        logits = forward.logits
        device = logits.device
        rows, seq = aligned.student_shape
        matched = aligned.match.size
        column = _to_device(torch.from_numpy(_columns(aligned.match.teacher_column, logits.shape[-1], matched)),
                            device)
        projected = torch.zeros(rows, seq, matched + 1, dtype=torch.float32, device=device)
        rest = torch.zeros(rows, seq, self.rest_topk, dtype=torch.float32, device=device)
        context = _to_device(aligned.context, device)
        # In float64, the softmax and its sums: the unmatched column adds up most of a large
        # vocabulary, where float32 missed by up to 6.8e-4 (262,144 entries); the matched add a few each.
        for r, c, probs in _aligned_probs(logits, context, torch.float64):
            projected[r, c] = torch.zeros(len(r), matched + 1, dtype=torch.float64, device=device).index_add_(
                1, column, probs).float()
            if self.rest_topk:
                rest[r, c] = probs.masked_fill(column != matched, 0.0).topk(self.rest_topk, dim=-1).values.float()
        tensors = [projected[..., :matched].contiguous(), projected[..., matched].contiguous()]
        return tensors + ([rest] if self.rest_topk else [])

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        probs, mass, *rest = tensors
        return {"projected_probs": probs, "unmatched_mass": mass, "unmatched_topk": rest[0] if rest else None}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        rest = [out.unmatched_topk] if out.unmatched_topk is not None else []
        return [out.projected_probs, out.unmatched_mass, *rest]

    def __str__(self) -> str:
        return f"projected(rest_topk={self.rest_topk}{', by prefix' if self.by_prefix else ''})"


@dataclass(frozen=True)
class SortedProbs(CrossTokenizerKind):
    """The k largest teacher next-token probabilities, sorted descending, float32 [B, S, k] (ULD
    compares sorted vectors, whatever the ids): at the positions ProjectedNext is defined at,
    zeros elsewhere."""

    k: int
    asked_as: ClassVar[str] = "cross_tokenizer.sorted_topk > 0"
    fields: ClassVar[tuple[str, ...]] = ("sorted_probs",)

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "SortedProbs | None":
        k = spec.cross_tokenizer.sorted_topk if spec.HasField("cross_tokenizer") else 0
        return cls(k) if k else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.cross_tokenizer.sorted_topk = self.k

    def check(self, teacher: TeacherFacts) -> None:
        _check_sorted_k("sorted_topk", self.k, teacher)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, self.k), torch.float32)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        aligned = batch.data[ALIGNMENT]
        rows, seq = aligned.student_shape
        values = torch.zeros(rows, seq, self.k, dtype=torch.float32, device=forward.logits.device)
        for r, c, probs in _aligned_probs(forward.logits, _to_device(aligned.context, forward.logits.device)):
            values[r, c] = probs.topk(self.k, dim=-1).values
        return [values]

    def __str__(self) -> str:
        return f"sorted_topk={self.k}"

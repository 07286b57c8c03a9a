"""The wire order of the kinds (`KINDS`), the OutputSpec that asks for some (`output_spec`), and a
session's request resolved against one teacher (`OutputRequest`): the only names the engine and
the client call."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from distill_common import wire
from distill_common.outputs.attention import AttentionInputs
from distill_common.outputs.base import (BatchDataError, BatchOutputs, ForwardNeeds, JoinData, Output,
                                         OutputSpecError, TeacherFacts, TeacherOutput, TensorSpec,
                                         VocabularyMismatch)
from distill_common.outputs.cross_tokenizer import ProjectedNext, SortedProbs, SpanLogprobs
from distill_common.outputs.hidden import AuxHiddenStates, FinalHidden, HiddenStates
from distill_common.outputs.logits import Argmax, Logits, SubsetLogits, TopK
from distill_common.outputs.logprobs import NextTokenLogprobs, ScoredLogprobs
from distill_common.proto.teacher.v1 import teacher_pb2 as pb


# Every kind, in wire order: a session's tensors are sent kind by kind in this order.
KINDS: tuple[type[Output], ...] = (Logits, TopK, HiddenStates, FinalHidden, AttentionInputs, SubsetLogits,
                                   AuxHiddenStates, Argmax, NextTokenLogprobs, ScoredLogprobs, SpanLogprobs,
                                   ProjectedNext, SortedProbs)


def output_spec(kinds: Iterable[Output], dtype: str | None = None) -> pb.OutputSpec:
    """The OutputSpec that asks for `kinds` (in any order), in `dtype` (None: the teacher's)."""
    spec = pb.OutputSpec(dtype=dtype or "")
    seen = set()
    for kind in kinds:
        if not isinstance(kind, Output):
            raise TypeError(f"outputs must be kinds such as Logits(), TopK(8), HiddenStates((1, 2)); got {kind!r}")
        if type(kind) in seen:
            raise ValueError(f"outputs ask for {type(kind).__name__} twice: ask for each kind once")
        seen.add(type(kind))
        kind.to_spec(spec)
    return spec


@dataclass(frozen=True)
class OutputRequest:
    """What one session asked for, resolved against one teacher: its kinds in wire order."""

    kinds: tuple[Output, ...]
    dtype: torch.dtype
    teacher: TeacherFacts

    @classmethod
    def resolve(cls, spec: pb.OutputSpec, teacher: TeacherFacts) -> "OutputRequest":
        """The request `spec` makes of `teacher`; OutputSpecError when the teacher cannot serve it."""
        kinds = []
        for kind_class in KINDS:
            kind = kind_class.from_spec(spec)
            if kind is not None:
                kind = kind.for_teacher(teacher)
                kind.check(teacher)
                kinds.append(kind)
        if not kinds:
            *others, last = [kind_class.asked_as for kind_class in KINDS]
            raise OutputSpecError(f"no outputs requested: ask for {', '.join(others)} or {last}")
        crossing = [kind for kind in kinds if kind.cross_tokenizer]
        if crossing and len(crossing) != len(kinds):
            others = ", ".join(str(kind) for kind in kinds if not kind.cross_tokenizer)
            raise OutputSpecError(f"cross_tokenizer outputs are shaped to the student's tokens and {others} to the "
                                  "teacher's: a session asks for one or the other (join twice for both)")
        try:
            dtype = wire.parse_output_dtype(spec.dtype) if spec.dtype else teacher.dtype
        except wire.WireError as e:
            raise OutputSpecError(f"outputs.dtype: {e}") from e
        return cls(tuple(kinds), dtype, teacher)

    @classmethod
    def granted(cls, spec: pb.OutputSpec, joined: pb.JoinResponse) -> "OutputRequest":
        """The student's copy of the request the teacher resolved at `joined` (same spec, same facts)."""
        asked = pb.OutputSpec()
        asked.CopyFrom(spec)
        asked.dtype = joined.output_dtype
        granted = cls.resolve(asked, TeacherFacts.from_info(joined.info))
        if granted.cross_tokenizer:
            alignment = joined.alignment
            granted = granted.aligned(alignment.student_vocab_size, int(alignment.matched_student_ids.shape[0])
                                      if alignment.matched_student_ids.shape else 0)
        return granted

    @functools.cached_property
    def cross_tokenizer(self) -> bool:
        """Whether its kinds are shaped to the student's own tokens (then all of them are)."""
        return any(kind.cross_tokenizer for kind in self)

    def aligned(self, student_vocab_size: int, matched_entries: int) -> "OutputRequest":
        """This request with the session's vocabulary match (found at Join) in its facts."""
        return dataclasses.replace(self, teacher=dataclasses.replace(
            self.teacher, student_vocab_size=student_vocab_size, matched_entries=matched_entries))

    def __iter__(self) -> Iterator[Output]:
        return iter(self.kinds)

    def __str__(self) -> str:
        return f"{', '.join(map(str, self.kinds))} in {wire.dtype_name(self.dtype)}"

    def check_student(self, vocab_size: int, tokenizer_fingerprint: str) -> None:
        """Raises VocabularyMismatch when a kind asked needs the teacher's vocabulary and the
        student's differs (0 and "" are unknown: not compared)."""
        if not any(kind.same_vocabulary for kind in self):
            return  # hidden states only: vocabularies may differ
        if vocab_size and vocab_size != self.teacher.vocab_size:
            raise VocabularyMismatch(
                f"the student's vocabulary has {vocab_size} entries, the teacher's {self.teacher.vocab_size}: "
                "logit distillation needs the same tokenizer on both sides (hidden-state distillation does not)")
        theirs, ours = tokenizer_fingerprint, self.teacher.tokenizer_fingerprint
        if theirs and ours and theirs != ours:
            raise VocabularyMismatch(
                "the student's tokenizer differs from the teacher's (fingerprints "
                f"{theirs[:12]} != {ours[:12]}): logit distillation needs the same tokenizer on both sides")

    @functools.cached_property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds.union(kind.needs for kind in self)

    @functools.cached_property
    def reads_batch_data(self) -> bool:
        """Whether its batches carry data of their own (then derived for themselves, never shared)."""
        return any(kind.batch_field for kind in self)

    def write_batch(self, request: pb.SubmitRequest, batch: int, seq: int, **data: torch.Tensor | None) -> None:
        """The student's side: puts the data its kinds read with a [batch, seq] input into
        `request` (keyword: the kind's batch_field). ValueError when some is missing, unasked or malformed."""
        given = {name: value for name, value in data.items() if value is not None}
        written = set()  # a field several kinds read (student_text) is written once
        for kind in self:
            if kind.batch_field and kind.batch_field not in written:
                if kind.batch_field not in given:
                    raise ValueError(f"this session asked for {kind} at join: pass {kind.batch_field} with every batch")
                value = kind.write_batch(given.pop(kind.batch_field), batch, seq, self.teacher)
                getattr(request, kind.batch_field).CopyFrom(value)
                written.add(kind.batch_field)
        if given:
            raise ValueError(f"{', '.join(sorted(given))} given, but this session asked for no output that reads it "
                             f"(outputs: {self})")

    def read_batch(self, request: pb.SubmitRequest, batch: int, seq: int) -> dict[str, torch.Tensor]:
        """The teacher's side: the data sent with a [batch, seq] input for the kinds asked, by
        field, validated; BatchDataError when some is missing, unasked or malformed."""
        data = {}
        for kind in self:
            if kind.batch_field and kind.batch_field not in data:
                if not request.HasField(kind.batch_field):
                    raise BatchDataError(f"{kind.batch_field} is missing: this session asked for {kind} at join, so "
                                         f"every batch must send it")
                data[kind.batch_field] = kind.read_batch(getattr(request, kind.batch_field), batch, seq, self.teacher)
        for kind_class in KINDS:
            name = kind_class.batch_field
            if name and name not in data and request.HasField(name):
                raise BatchDataError(f"{name} was sent, but this session did not ask for it at join "
                                     f"(OutputSpec: {kind_class.asked_as}): leave it out or join asking for it")
        return data

    def layout(self, batch: int, seq: int) -> list[TensorSpec]:
        """The tensors the teacher sends for a [batch, seq] input, in send order."""
        return [spec for kind in self for spec in kind.layout(batch, seq, self.teacher, self.dtype)]

    def derive(self, forward: BatchOutputs, batch) -> list[torch.Tensor]:
        """The teacher's tensors for `batch` from its forward, in send order."""
        return [tensor for kind in self for tensor in kind.derive(forward, batch, self.dtype)]

    def assemble(self, batch_id: int, tensors: list[torch.Tensor]) -> TeacherOutput:
        """The student's TeacherOutput from the tensors received for one batch, in send order."""
        fields, start = {}, 0
        for kind in self:
            count = len(kind.layout(1, 1, self.teacher, self.dtype))
            fields.update(kind.assemble(tensors[start:start + count]))
            start += count
        return TeacherOutput(batch_id=batch_id, **fields)

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        """The inverse of `assemble`: the tensors of `out`, in send order."""
        return [tensor for kind in self for tensor in kind.disassemble(out)]

    # ---- once, at join: sent right after the handshake, before any batch -----------------

    def join_layout(self) -> list[TensorSpec]:
        """The tensors the teacher sends once at join, in send order (empty: nothing)."""
        return [spec for kind in self for spec in kind.join_layout(self.teacher, self.dtype)]

    def join_derive(self, source: JoinData) -> list[torch.Tensor]:
        """The teacher's join-time tensors from what its model offers, in send order."""
        return [tensor for kind in self for tensor in kind.join_derive(source, self.dtype)]

    def join_assemble(self, tensors: list[torch.Tensor]) -> JoinData:
        """The student's JoinData from the tensors received at join, in send order."""
        fields, start = {}, 0
        for kind in self:
            count = len(kind.join_layout(self.teacher, self.dtype))
            fields.update(kind.join_assemble(tensors[start:start + count], self.teacher))
            start += count
        return JoinData(**fields)

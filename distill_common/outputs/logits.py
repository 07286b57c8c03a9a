"""Kinds over the teacher's vocabulary: the full logits, their top-k, a subset of them, the argmax."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from distill_common import wire
from distill_common.outputs.base import (BatchOutputs, ForwardNeeds, Output, OutputSpecError, TeacherFacts,
                                         TensorSpec, _few)
from distill_common.outputs.logprobs import _check_temperature, _logprobs_at, _temperature_to_spec
from distill_common.proto.teacher.v1 import teacher_pb2 as pb


@dataclass(frozen=True)
class Logits(Output):
    """The full logits [B, S, V]."""

    asked_as: ClassVar[str] = "logits"
    fields: ClassVar[tuple[str, ...]] = ("logits",)
    same_vocabulary: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "Logits | None":
        return cls() if spec.logits else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.logits = True

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(logits=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, teacher.vocab_size), dtype)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [forward.logits.to(dtype).contiguous()]

    def __str__(self) -> str:
        return "logits"


@dataclass(frozen=True)
class TopK(Output):
    """The k most likely next tokens per position: their log-probabilities under the full softmax
    at `temperature`, values [B, S, k] in the session's dtype (largest first), and their int32
    vocabulary ids [B, S, k].

    1 - sum(exp(values)) is the teacher's mass outside the k ids, which the student's loss keeps
    as one outcome (student_trainer/losses.py: `topk_kd_loss`); raw logits would leave it unknown.
    The temperature is applied here, once: the student divides only its own logits by it. The
    teacher's `TeacherInfo.topk_form` says which form it sends, and a teacher that sends another
    (one older than that field, which sent raw logits) is refused at join. The values' precision
    is the session's dtype: what a store of teacher outputs keeps, 16 bits and an int32 id a value.
    """

    k: int
    temperature: float = 1.0
    asked_as: ClassVar[str] = "topk > 0"
    fields: ClassVar[tuple[str, ...]] = ("topk_values", "topk_indices")
    same_vocabulary: ClassVar[bool] = True
    form: ClassVar[int] = pb.TOPK_FORM_LOGPROBS

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "TopK | None":
        return cls(spec.topk, spec.logprob_temperature or 1.0) if spec.topk else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.topk = self.k
        _temperature_to_spec(spec, self.temperature)

    def check(self, teacher: TeacherFacts) -> None:
        if not 0 < self.k <= teacher.vocab_size:
            raise OutputSpecError(f"topk {self.k} must be between 0 and the vocabulary size {teacher.vocab_size}")
        if teacher.max_topk and self.k > teacher.max_topk:
            raise OutputSpecError(f"topk {self.k} exceeds the teacher's --max-topk {teacher.max_topk}: ask for at "
                                  "most that many, or start the teacher with a larger --max-topk")
        _check_temperature(self.temperature)
        if teacher.topk_form != self.form:
            raise OutputSpecError(
                f"the teacher sends its top-k as {pb.TopKForm.Name(teacher.topk_form)}, not log-probabilities "
                "(a teacher_server older than TeacherInfo.topk_form sends raw logits, whose tail mass is unknown): "
                "upgrade the teacher, or distil from its full logits")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(logits=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, self.k), dtype), TensorSpec((batch, seq, self.k), torch.int32)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        # The ids from the logits as they came (a positive temperature keeps their order), then one
        # float32 log-sum-exp over the vocabulary per row, in row chunks.
        indices = torch.topk(forward.logits, self.k, dim=-1).indices
        values = _logprobs_at(forward.logits, indices, self.temperature)
        return [values.to(dtype).contiguous(), indices.to(torch.int32).contiguous()]

    def __str__(self) -> str:
        return f"topk={self.k}(T={self.temperature:g})"


@dataclass(frozen=True)
class SubsetLogits(Output):
    """The logits of some vocabulary ids [B, S, len(token_ids)], column i for token_ids[i]:
    an EAGLE-3 draft's vocabulary asks for N of the teacher's V logits once, at join."""

    token_ids: tuple[int, ...]
    asked_as: ClassVar[str] = "logit_subset"
    fields: ClassVar[tuple[str, ...]] = ("subset_logits",)
    same_vocabulary: ClassVar[bool] = True

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(int(i) for i in self.token_ids))

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "SubsetLogits | None":
        if not spec.HasField("logit_subset"):
            return None
        try:
            # Bounded by the bytes that came (decode checks them against the shape), not by a claimed shape.
            ids = wire.decode(spec.logit_subset, what="outputs.logit_subset", dtypes=wire.ID_DTYPES,
                              max_elements=len(spec.logit_subset.data))
        except wire.WireError as e:
            raise OutputSpecError(f"{e}: send the subset as a 1-D int32 or int64 tensor of vocabulary ids") from e
        if ids.dim() != 1:
            raise OutputSpecError(f"outputs.logit_subset has shape {list(ids.shape)}: send a 1-D tensor of "
                                  "vocabulary ids")
        return cls(tuple(ids.tolist()))

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.logit_subset.CopyFrom(wire.encode(torch.tensor(self.token_ids, dtype=torch.int32)))

    def check(self, teacher: TeacherFacts) -> None:
        if not self.token_ids:
            raise OutputSpecError("outputs.logit_subset is empty: send at least one vocabulary id (leave the field "
                                  "out to ask for no subset)")
        outside = sorted({i for i in self.token_ids if not 0 <= i < teacher.vocab_size})
        if outside:
            raise OutputSpecError(f"outputs.logit_subset has ids outside the teacher's vocabulary [0, "
                                  f"{teacher.vocab_size}): {_few(outside)}; keep only ids below {teacher.vocab_size}")
        if len(set(self.token_ids)) != len(self.token_ids):
            seen, repeated = set(), set()
            for i in self.token_ids:
                (repeated if i in seen else seen).add(i)
            raise OutputSpecError(f"outputs.logit_subset repeats ids {_few(sorted(repeated))}: send each id once")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(logits=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, len(self.token_ids)), dtype)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [forward.logits.index_select(-1, self._index(forward.logits.device)).to(dtype).contiguous()]

    def _index(self, device: torch.device) -> torch.Tensor:
        index = self._indices.get(device)
        if index is None:
            index = self._indices[device] = torch.tensor(self.token_ids, dtype=torch.long, device=device)
        return index

    @functools.cached_property
    def _indices(self) -> dict:
        return {}  # device -> the ids as a tensor there, built once

    @functools.cached_property
    def _hash(self) -> int:
        return hash(self.token_ids)

    def __hash__(self) -> int:
        # A request is a dict key for every batch sent (delivery.py): 32k ids are hashed once, not per batch.
        return self._hash

    def __str__(self) -> str:
        return f"logit_subset={len(self.token_ids)} ids"



@dataclass(frozen=True)
class Argmax(Output):
    """The teacher's greedy next token at each position: the full vocabulary's argmax, int32 [B, S]."""

    asked_as: ClassVar[str] = "argmax"
    fields: ClassVar[tuple[str, ...]] = ("argmax",)
    same_vocabulary: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "Argmax | None":
        return cls() if spec.argmax else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.argmax = True

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(logits=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq), torch.int32)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [forward.logits.argmax(dim=-1).to(torch.int32).contiguous()]

    def __str__(self) -> str:
        return "argmax"

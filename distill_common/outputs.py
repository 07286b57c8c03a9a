"""Teacher outputs: each kind a session can ask for is one class.

A kind (`Output`) says, in one place:

- how a session asks for it: `from_spec` reads its field(s) of the proto `OutputSpec`,
  `to_spec` writes them;
- what the teacher checks at join: `check` raises `OutputSpecError` when this model cannot
  give it, and `same_vocabulary` says whether the student must share the teacher's tokenizer;
- what the forward must produce for it (`needs`, a `ForwardNeeds`);
- its tensors for one `[batch, seq]` input (`layout`), which the student preallocates;
- how the teacher derives them from the forward of one batch (`derive`);
- how the student turns them into fields of a `TeacherOutput` (`assemble`);
- what it sends once, at join (`join_layout`, `join_derive`, `join_assemble`; most kinds nothing).

Its place in the wire order is its place in `KINDS`. A session's `OutputRequest` is the kinds
it asked for, resolved against one teacher: frozen and hashable, so sessions that ask the same
share what the teacher derives. The engine and the client call only the request's methods;
neither names a kind.

Per-batch data. What a kind needs from the student with every batch (ids to score, say) is a
field of `SubmitRequest` named by the kind's `batch_field`: the student's `write_batch` checks
and encodes it, the teacher's `read_batch` validates it at Submit (`BatchDataError`, the
client gets `INVALID_ARGUMENT`), and `derive` finds it in `batch.data[batch_field]`. Batches
that carry such data are derived for themselves: two sessions whose batches share a forward
(the same ids and mask) but not their data are each sent their own tensors.

Join-time data. What a kind needs from the student once (a token subset, say) is a field of
its `OutputSpec`, read in `from_spec` and checked in `check` like `TopK.k`. What it needs from
the teacher once (the weights of its output head, say) is too large for the control plane: it
crosses the session group once, right after the handshake and before any batch. The kind says
what (`join_layout`: the student preallocates it), takes it from the teacher's `JoinData`
(`join_derive`: `JoinData` holds what the teacher's model offers once, gathered whole under
tensor parallelism) and turns the received tensors into fields of the student's `JoinData`
(`join_assemble`: `TeacherClient.joined`). Both ends call the request's `join_*` methods right
after `handshake` (teacher_server/delivery.py, student_trainer/client.py); a kind with nothing
to send at join keeps the defaults, which send nothing. What a kind leaves to the teacher
(`AuxHiddenStates`' default layers, which depend on its depth) is filled in by `for_teacher`
before the check, on both sides alike, so the student's granted request holds the same layers
as the teacher's.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from distill_common import wire
from distill_common.quantization import Quantization
from distill_common.proto.teacher.v1 import teacher_pb2 as pb


class OutputSpecError(ValueError):
    """A session asked for outputs the teacher cannot give; the message says what to change."""


class VocabularyMismatch(ValueError):
    """The outputs asked need the teacher's vocabulary, and the student's differs."""


class BatchDataError(ValueError):
    """Data sent with a batch for a kind (ids to score) is missing or malformed; the message says what to change."""


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


# Why a teacher that says nothing about a capability (an older one) cannot give it.
_NOT_REPORTED = "this teacher does not report it (an older teacher_server?)"


@dataclass(frozen=True)
class HeadFacts:
    """The teacher's output head as TeacherInfo.head describes it: logits =
    softcap(logit_scale * (h W^T + b)); `unavailable` says why the student cannot apply it."""

    bias: bool = False
    final_logit_softcapping: float = 0.0
    logit_scale: float = 1.0
    unavailable: str = _NOT_REPORTED

    @classmethod
    def from_info(cls, head: pb.OutputHeadInfo) -> "HeadFacts":
        return cls(bias=head.bias, final_logit_softcapping=head.final_logit_softcapping,
                   logit_scale=head.logit_scale, unavailable=head.unavailable)

    def to_info(self) -> pb.OutputHeadInfo:
        return pb.OutputHeadInfo(bias=self.bias, final_logit_softcapping=self.final_logit_softcapping,
                                 logit_scale=self.logit_scale, unavailable=self.unavailable)


@dataclass(frozen=True)
class AttentionFacts:
    """The widths of one layer's attention inputs (TeacherInfo.attention); `unavailable` says
    why the teacher cannot send them."""

    query_width: int = 0
    key_width: int = 0
    value_width: int = 0
    unavailable: str = _NOT_REPORTED

    @classmethod
    def from_info(cls, attention: pb.AttentionInputsInfo) -> "AttentionFacts":
        return cls(query_width=attention.query_width, key_width=attention.key_width,
                   value_width=attention.value_width, unavailable=attention.unavailable)

    def to_info(self) -> pb.AttentionInputsInfo:
        return pb.AttentionInputsInfo(query_width=self.query_width, key_width=self.key_width,
                                      value_width=self.value_width, unavailable=self.unavailable)


@dataclass(frozen=True)
class TeacherFacts:
    """What a session's outputs depend on, as the join answer (TeacherInfo) tells it."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: torch.dtype  # the model's: outputs come in it unless the session asks another
    tokenizer_fingerprint: str = ""
    max_topk: int = 0  # the teacher's --max-topk (0: up to the vocabulary size)
    head: HeadFacts = HeadFacts()
    attention: AttentionFacts = AttentionFacts()
    max_score_ids: int = 0  # the teacher's --max-score-ids
    # A session of cross-tokenizer outputs (CrossTokenizerKind): the student vocabulary's entries and how
    # many of them some teacher id spells exactly (the columns of ProjectedNext), found at Join.
    student_vocab_size: int = 0
    matched_entries: int = 0
    quantization: Quantization = Quantization()  # what the teacher's decoder linears run in
    topk_form: int = pb.TOPK_FORM_LOGPROBS  # what its top-k values are (TopK.form: this code's)

    @classmethod
    def from_info(cls, info: pb.TeacherInfo) -> "TeacherFacts":
        return cls(vocab_size=info.vocab_size, hidden_size=info.hidden_size, num_layers=info.num_layers,
                   dtype=wire.parse_output_dtype(info.dtype), tokenizer_fingerprint=info.tokenizer_fingerprint,
                   head=HeadFacts.from_info(info.head) if info.HasField("head") else HeadFacts(),
                   attention=(AttentionFacts.from_info(info.attention) if info.HasField("attention")
                              else AttentionFacts()),
                   max_score_ids=info.max_score_ids, topk_form=info.topk_form,
                   quantization=(Quantization.from_info(info.quantization) if info.HasField("quantization")
                                 else Quantization()))


@dataclass
class OutputHead:
    """A model's output head, applied outside the model: logits = softcap(logit_scale * (h W^T + b)),
    softcap(x) = c * tanh(x / c) when c = final_logit_softcapping > 0.

    The teacher's `JoinData.head` (its own weights, gathered whole under tensor parallelism)
    and, once received, the student's (`TeacherClient.joined.head`).
    """

    weight: torch.Tensor  # [vocab, hidden]
    bias: torch.Tensor | None = None  # [vocab]
    final_logit_softcapping: float = 0.0
    logit_scale: float = 1.0

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logits of `hidden` [..., H]: the matrix product in the weight's dtype (as the
        teacher computes it), the scale and the cap in `dtype` (default: the weight's)."""
        logits = F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        if dtype is not None:
            logits = logits.to(dtype)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def facts(self) -> HeadFacts:
        return HeadFacts(bias=self.bias is not None, final_logit_softcapping=float(self.final_logit_softcapping),
                         logit_scale=float(self.logit_scale), unavailable="")


@dataclass
class JoinData:
    """What crosses a session group once, at join: on the teacher, what its model offers (each
    field None where it has none to give); on the student, what its kinds received."""

    head: OutputHead | None = None


@dataclass(frozen=True)
class ForwardNeeds:
    """What a forward must produce.

    A kind that needs more of the forward adds a field here, merges it in `__or__`, and has
    `BatchOutputs` keep it. Logits are a need like the others: a forward that no session
    needs them for runs the decoder without the output head, so a teacher serving final
    hidden states never holds [B, S, V] logits.
    """

    hidden_layers: frozenset[int] = frozenset()
    logits: bool = False
    attention_layers: frozenset[int] = frozenset()  # decoder layers (0-based) whose q, k, v are kept
    final_hidden: bool = False  # the output head's input [B, S, H]

    def __or__(self, other: "ForwardNeeds") -> "ForwardNeeds":
        return ForwardNeeds(hidden_layers=self.hidden_layers | other.hidden_layers,
                            logits=self.logits or other.logits,
                            attention_layers=self.attention_layers | other.attention_layers,
                            final_hidden=self.final_hidden or other.final_hidden)

    @classmethod
    def union(cls, needs: Iterable["ForwardNeeds"]) -> "ForwardNeeds":
        return functools.reduce(operator.or_, needs, cls())

    @property
    def hidden_states(self) -> bool:
        """Whether the model must return its hidden states."""
        return bool(self.hidden_layers)


@dataclass
class BatchOutputs:
    """What the forward produced for one batch, in the teacher's dtype: logits [B, S, V] (None
    when no session needed them), hidden states [B, S, H] by layer, attention inputs (q, k, v),
    each [B, S, width], by decoder layer (only the layers kept), and the output head's input
    [B, S, H] (None when not needed)."""

    logits: torch.Tensor | None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    final_hidden: torch.Tensor | None = None

    @classmethod
    def of_rows(cls, forward, needs: ForwardNeeds, rows: slice, seq: int) -> "BatchOutputs":
        """One batch's rows of a packed forward (`logits`, `hidden_states` by layer, `attention`
        by layer, `final_hidden`), keeping what `needs` asks."""
        return cls(forward.logits[rows, :seq] if needs.logits else None,
                   {layer: forward.hidden_states[layer][rows, :seq] for layer in sorted(needs.hidden_layers)},
                   {layer: tuple(t[rows, :seq] for t in forward.attention[layer])
                    for layer in sorted(needs.attention_layers)},
                   forward.final_hidden[rows, :seq] if needs.final_hidden else None)

    def _tensors(self) -> list[torch.Tensor]:
        tensors = [t for t in (self.logits, self.final_hidden) if t is not None]
        return tensors + list(self.hidden.values()) + [t for qkv in self.attention.values() for t in qkv]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def covers(self, needs: ForwardNeeds) -> bool:
        return ((not needs.logits or self.logits is not None) and needs.hidden_layers <= self.hidden.keys()
                and needs.attention_layers <= self.attention.keys()
                and (not needs.final_hidden or self.final_hidden is not None))

    def detached(self) -> "BatchOutputs":
        """A copy that owns its memory: a slice of the packed forward's outputs would
        keep the whole packed tensor alive, and the cache's byte count would lie."""
        return BatchOutputs(None if self.logits is None else self.logits.clone(),
                            {layer: h.clone() for layer, h in self.hidden.items()},
                            {layer: tuple(t.clone() for t in qkv) for layer, qkv in self.attention.items()},
                            None if self.final_hidden is None else self.final_hidden.clone())


@dataclass
class TeacherOutput:
    """One batch's outputs, on the client's device. Kinds not asked for are None / empty."""

    batch_id: int
    logits: torch.Tensor | None = None  # [B, S, V]
    topk_values: torch.Tensor | None = None  # [B, S, k]: log p at topk_indices (full softmax, at TopK.temperature)
    topk_indices: torch.Tensor | None = None  # [B, S, k] int32, most likely first
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, S, H]
    final_hidden: torch.Tensor | None = None  # [B, S, H]: apply TeacherClient.joined.head for logits
    # decoder layer -> (q [B, S, query_width], k [B, S, key_width], v [B, S, value_width])
    attention_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    subset_logits: torch.Tensor | None = None  # [B, S, len(subset)]
    aux_hidden_states: torch.Tensor | None = None  # [B, S, 3H]
    argmax: torch.Tensor | None = None  # [B, S] int32: the full vocabulary's argmax
    next_token_logprobs: torch.Tensor | None = None  # [B, S] float32: log p(x[t+1] | x[<=t]), 0 without one
    scored_logprobs: torch.Tensor | None = None  # [B, S, k] float32: log p(score_ids[b, t, j] | x[b, <=t])
    # Cross-tokenizer outputs, shaped to the student's tokens (position t: about its token t + 1).
    span_logprobs: torch.Tensor | None = None  # [B, S] float32: log p_teacher(bytes of token t+1 | bytes before)
    span_exact: torch.Tensor | None = None  # [B, S] bool: that token starts and ends on teacher boundaries
    projected_probs: torch.Tensor | None = None  # [B, S, M] float32: columns = joined matched_student_ids
    unmatched_mass: torch.Tensor | None = None  # [B, S] float32: the rest; matched + unmatched = 1 where aligned
    unmatched_topk: torch.Tensor | None = None  # [B, S, k] float32: the k largest unmatched, descending
    sorted_probs: torch.Tensor | None = None  # [B, S, k] float32: the k largest teacher probabilities, descending


class Output(abc.ABC):
    """One kind of teacher output (see the module's docstring). Subclasses are frozen dataclasses."""

    # How to ask for it, for the message that says nothing was asked.
    asked_as: ClassVar[str]
    # Whether it only means something to a student with the teacher's vocabulary.
    same_vocabulary: ClassVar[bool] = False
    # The SubmitRequest field it reads with every batch ("": none); see the module's docstring.
    batch_field: ClassVar[str] = ""
    # Whether it is shaped to the student's own tokens, the batch re-tokenized by the teacher
    # (CrossTokenizerKind): then every kind of the session must be.
    cross_tokenizer: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "Output | None":
        """This kind as `spec` asks for it; None when `spec` does not."""

    @abc.abstractmethod
    def to_spec(self, spec: pb.OutputSpec) -> None:
        """Writes this kind's field(s) of `spec`."""

    def for_teacher(self, teacher: TeacherFacts) -> "Output":
        """This kind with what it leaves to the teacher filled in (default: nothing is)."""
        return self

    def check(self, teacher: TeacherFacts) -> None:
        """Raises OutputSpecError when `teacher` cannot give this."""

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds()

    @abc.abstractmethod
    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        """The tensors this kind sends for a [batch, seq] input, in order; their number does not
        depend on the input's shape."""

    @abc.abstractmethod
    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        """This kind's tensors (contiguous, as `layout` says) from the forward of `batch`.

        `batch` is what the student submitted: its ids and mask, and in `batch.data` what a kind
        reads with each batch (ids to score, say). Sessions whose requests are equal and whose
        batches share a forward entry are sent the same derived tensors, unless the batches
        carry data (`OutputRequest.reads_batch_data`).
        """

    @abc.abstractmethod
    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        """The TeacherOutput fields this kind fills from its received tensors."""

    @abc.abstractmethod
    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        """The inverse of `assemble`: this kind's tensors, as `layout` says, from a TeacherOutput
        (what a store of teacher outputs keeps of it, student_trainer/store/)."""

    def join_layout(self, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        """The tensors this kind sends once, right after the handshake (none by default)."""
        return []

    def join_derive(self, source: JoinData, dtype: torch.dtype) -> list[torch.Tensor]:
        """Those tensors, from what the teacher's model offers (contiguous, as `join_layout` says)."""
        return []

    def join_assemble(self, tensors: list[torch.Tensor], teacher: TeacherFacts) -> dict:
        """The student's JoinData fields this kind fills from the tensors received at join."""
        return {}

    def write_batch(self, value: torch.Tensor, batch: int, seq: int, teacher: TeacherFacts) -> pb.Tensor:
        """The student's side of `batch_field`: `value` for a [batch, seq] input, checked against
        `teacher` and encoded (ValueError saying what to change). Only kinds with a `batch_field`."""
        raise NotImplementedError(f"{type(self).__name__} reads no data with a batch")

    def read_batch(self, tensor: pb.Tensor, batch: int, seq: int, teacher: TeacherFacts) -> torch.Tensor:
        """The teacher's side of `batch_field`: the tensor sent with a [batch, seq] input,
        validated (BatchDataError saying what to change). Only kinds with a `batch_field`."""
        raise NotImplementedError(f"{type(self).__name__} reads no data with a batch")


@dataclass(frozen=True)
class Logits(Output):
    """The full logits [B, S, V]."""

    asked_as: ClassVar[str] = "logits"
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

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (logits,) = tensors
        return {"logits": logits}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.logits]

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

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        values, indices = tensors
        return {"topk_values": values, "topk_indices": indices}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.topk_values, out.topk_indices]

    def __str__(self) -> str:
        return f"topk={self.k}(T={self.temperature:g})"


@dataclass(frozen=True)
class HiddenStates(Output):
    """Hidden states of some layers (HF output_hidden_states indexing: 0 is the embeddings,
    i is after layer i), sent stacked as [len(layers), B, S, H] in the order asked."""

    layers: tuple[int, ...]
    asked_as: ClassVar[str] = "hidden layers"

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))  # any sequence given: hashable all the same

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "HiddenStates | None":
        return cls(tuple(spec.hidden_layers)) if spec.hidden_layers else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.hidden_layers.extend(self.layers)

    def check(self, teacher: TeacherFacts) -> None:
        bad = [layer for layer in self.layers if not 0 <= layer <= teacher.num_layers]
        if bad:
            raise OutputSpecError(f"hidden layers {_few(bad)} are out of range: the teacher has {teacher.num_layers} "
                                  f"layers, so use 0 (embeddings) .. {teacher.num_layers}")
        if len(set(self.layers)) != len(self.layers):
            raise OutputSpecError(f"hidden layers {_few(list(self.layers))} repeat a layer: ask for each once")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(hidden_layers=frozenset(self.layers))

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((len(self.layers), batch, seq, teacher.hidden_size), dtype)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.stack([forward.hidden[layer] for layer in self.layers]).to(dtype).contiguous()]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (stacked,) = tensors
        return {"hidden_states": {layer: stacked[i] for i, layer in enumerate(self.layers)}}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [torch.stack([out.hidden_states[layer] for layer in self.layers])]

    def __str__(self) -> str:
        return f"hidden_layers={self.layers}"


@dataclass(frozen=True)
class FinalHidden(Output):
    """The output head's input [B, S, H] (the final normed hidden state), and the head itself
    once at join, so that the student computes the teacher's logits (student_trainer/losses.py:
    `kd_loss_from_hidden`): vocab / hidden times fewer bytes per token than the logits, and no
    [B, S, V] teacher tensor on either side. The student finds the head in `TeacherClient.joined.head`."""

    asked_as: ClassVar[str] = "final_hidden"
    same_vocabulary: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "FinalHidden | None":
        return cls() if spec.final_hidden else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.final_hidden = True

    def check(self, teacher: TeacherFacts) -> None:
        if teacher.head.unavailable:
            raise OutputSpecError(f"the teacher cannot send its output head to apply on the student: "
                                  f"{teacher.head.unavailable}; distil from its logits or top-k instead")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(final_hidden=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, teacher.hidden_size), dtype)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [forward.final_hidden.to(dtype).contiguous()]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (final_hidden,) = tensors
        return {"final_hidden": final_hidden}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.final_hidden]

    def join_layout(self, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        weight = TensorSpec((teacher.vocab_size, teacher.hidden_size), dtype)
        return [weight, TensorSpec((teacher.vocab_size,), dtype)] if teacher.head.bias else [weight]

    def join_derive(self, source: JoinData, dtype: torch.dtype) -> list[torch.Tensor]:
        head = source.head
        return [t.to(dtype).contiguous() for t in (head.weight, head.bias) if t is not None]

    def join_assemble(self, tensors: list[torch.Tensor], teacher: TeacherFacts) -> dict:
        weight, *bias = tensors
        return {"head": OutputHead(weight, bias[0] if bias else None,
                                   final_logit_softcapping=teacher.head.final_logit_softcapping,
                                   logit_scale=teacher.head.logit_scale)}

    def __str__(self) -> str:
        return "final_hidden"


@dataclass(frozen=True)
class AttentionInputs(Output):
    """Queries, keys and values of some decoder layers (0-based), as each layer hands them to its
    attention function: after the rotary embedding, key/value heads grouped as the model has
    them (distill_common/attention_inputs.py). Sent as three stacks in the order asked:
    q [len(layers), B, S, query_width], k [..., key_width], v [..., value_width]."""

    layers: tuple[int, ...]
    asked_as: ClassVar[str] = "attention layers"

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "AttentionInputs | None":
        return cls(tuple(spec.attention_layers)) if spec.attention_layers else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.attention_layers.extend(self.layers)

    def check(self, teacher: TeacherFacts) -> None:
        if teacher.attention.unavailable:
            raise OutputSpecError(f"the teacher cannot send attention inputs: {teacher.attention.unavailable}")
        bad = [layer for layer in self.layers if not 0 <= layer < teacher.num_layers]
        if bad:
            raise OutputSpecError(f"attention layers {_few(bad)} are out of range: the teacher has "
                                  f"{teacher.num_layers} decoder layers, so use 0 .. {teacher.num_layers - 1}")
        if len(set(self.layers)) != len(self.layers):
            raise OutputSpecError(f"attention layers {_few(list(self.layers))} repeat a layer: ask for each once")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(attention_layers=frozenset(self.layers))

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        widths = (teacher.attention.query_width, teacher.attention.key_width, teacher.attention.value_width)
        return [TensorSpec((len(self.layers), batch, seq, width), dtype) for width in widths]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.stack([forward.attention[layer][part] for layer in self.layers]).to(dtype).contiguous()
                for part in range(3)]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        queries, keys, values = tensors
        return {"attention_inputs": {layer: (queries[i], keys[i], values[i]) for i, layer in enumerate(self.layers)}}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [torch.stack([out.attention_inputs[layer][part] for layer in self.layers]) for part in range(3)]

    def __str__(self) -> str:
        return f"attention_layers={self.layers}"


@dataclass(frozen=True)
class SubsetLogits(Output):
    """The logits of some vocabulary ids [B, S, len(token_ids)], column i for token_ids[i]:
    an EAGLE-3 draft's vocabulary asks for N of the teacher's V logits once, at join."""

    token_ids: tuple[int, ...]
    asked_as: ClassVar[str] = "logit_subset"
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

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (logits,) = tensors
        return {"subset_logits": logits}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.subset_logits]

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


# How many layers an EAGLE-3 draft's projection reads (fc: 3 x hidden -> hidden in vLLM, SGLang, SpecForge).
AUX_LAYERS = 3


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers vLLM (`get_eagle3_aux_hidden_state_layers`), SGLang (`set_eagle3_layers_to_capture`)
    and the EAGLE-3 reference (traineagle3/modeling_llama_kv.py) capture: the input of layers 2,
    L // 2 and L - 3, which is HF output_hidden_states index 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class AuxHiddenStates(Output):
    """Three layers' hidden states concatenated along the hidden dimension, [B, S, 3H] (HF
    output_hidden_states indexing, in the order asked); no layers: the reference default for
    the teacher's depth (`default_aux_layers`)."""

    layers: tuple[int, ...] = ()
    asked_as: ClassVar[str] = "aux_hidden_states"

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(int(layer) for layer in self.layers))

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "AuxHiddenStates | None":
        return cls(tuple(spec.aux_hidden_states.layers)) if spec.HasField("aux_hidden_states") else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.aux_hidden_states.SetInParent()  # present even with no layers: "the default ones"
        spec.aux_hidden_states.layers.extend(self.layers)

    def for_teacher(self, teacher: TeacherFacts) -> "AuxHiddenStates":
        if self.layers:
            return self
        layers = default_aux_layers(teacher.num_layers)
        if teacher.num_layers < 7:  # below 7 the three default layers are not distinct and in range
            raise OutputSpecError(
                f"aux_hidden_states: the default layers (2, L // 2, L - 3) need a teacher of at least 7 layers, this "
                f"one has {teacher.num_layers} (they would be {layers}); name three layers in 0 .. "
                f"{teacher.num_layers}, e.g. {tuple(sorted({0, teacher.num_layers // 2, teacher.num_layers}))}")
        return AuxHiddenStates(layers)

    def check(self, teacher: TeacherFacts) -> None:
        if len(self.layers) != AUX_LAYERS:
            raise OutputSpecError(f"aux_hidden_states asks for {len(self.layers)} layers {_few(list(self.layers))}: an "
                                  f"EAGLE-3 draft reads exactly {AUX_LAYERS} (low, middle, high), or none for the "
                                  "teacher's default ones")
        bad = [layer for layer in self.layers if not 0 <= layer <= teacher.num_layers]
        if bad:
            raise OutputSpecError(f"aux_hidden_states layers {bad} are out of range: the teacher has "
                                  f"{teacher.num_layers} layers, so use 0 (embeddings) .. {teacher.num_layers}")
        if len(set(self.layers)) != len(self.layers):
            raise OutputSpecError(f"aux_hidden_states layers {list(self.layers)} repeat a layer: name three "
                                  "different ones")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(hidden_layers=frozenset(self.layers))

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, len(self.layers) * teacher.hidden_size), dtype)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.cat([forward.hidden[layer].to(dtype) for layer in self.layers], dim=-1).contiguous()]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (concatenated,) = tensors
        return {"aux_hidden_states": concatenated}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.aux_hidden_states]

    def __str__(self) -> str:
        return f"aux_hidden_states={self.layers}"


@dataclass(frozen=True)
class Argmax(Output):
    """The teacher's greedy next token at each position: the full vocabulary's argmax, int32 [B, S]."""

    asked_as: ClassVar[str] = "argmax"
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

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (ids,) = tensors
        return {"argmax": ids}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.argmax]

    def __str__(self) -> str:
        return "argmax"


def _few(ids: list[int], shown: int = 8) -> str:
    """A list of ids for a message: the first few and how many more."""
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"{ids[:shown]}{more}"


def _logprobs_at(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) gathered at `ids`: float32 [B, S, k] from logits
    [B, S, V] and int64 ids [B, S, k].

    Row chunks of at most _LOGPROB_CHUNK_BYTES in float32: a bfloat16 forward of 16k tokens
    over a 128k vocabulary would otherwise need an 8 GB float32 copy next to its logits.
    """
    batch, seq, vocab = logits.shape
    k = ids.shape[-1]
    rows, index = logits.reshape(batch * seq, vocab), ids.reshape(batch * seq, k)
    values = torch.empty(batch * seq, k, dtype=torch.float32, device=logits.device)
    step = max(1, _LOGPROB_CHUNK_BYTES // (4 * vocab))
    for start in range(0, batch * seq, step):
        scaled = rows[start:start + step].float()
        if temperature != 1.0:
            scaled = scaled / temperature
        values[start:start + step] = scaled.gather(1, index[start:start + step]) - scaled.logsumexp(1, keepdim=True)
    return values.view(batch, seq, k)


_LOGPROB_CHUNK_BYTES = 256 << 20


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor of the batch on the forward's device, without waiting for the device: a copy
    from pageable memory would wait for everything queued on the stream (this very forward),
    holding up the engine thread, which launches the next forward meanwhile."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# The smallest logprob_temperature served. The log-probabilities are computed in float32 as
# logits / T: below about 1e-38 / |logit| that overflows (or T itself rounds to 0) and they come
# out NaN and -inf. 1e-3 leaves room for logits up to 1e35; a student after the greedy token asks
# for Argmax.
MIN_LOGPROB_TEMPERATURE = 1e-3


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise OutputSpecError(f"logprob_temperature {temperature} must be positive and finite (0 means 1)")
    if temperature < MIN_LOGPROB_TEMPERATURE:
        raise OutputSpecError(f"logprob_temperature {temperature:g} is too small to compute in float32 (the values "
                              f"would overflow to NaN): use at least {MIN_LOGPROB_TEMPERATURE:g}, or ask for argmax "
                              "for the teacher's greedy token")


def _temperature_to_spec(spec: pb.OutputSpec, temperature: float) -> None:
    """Both log-probability kinds share the spec's one temperature: asking for two differing is an error.

    Checked here, on the student: 0 on the wire means 1, so a kind asking for 0 would be
    served at 1 (or at the other kind's temperature) without a word."""
    try:
        _check_temperature(temperature)
    except OutputSpecError as e:
        raise ValueError(str(e)) from None
    if spec.logprob_temperature and spec.logprob_temperature != temperature:
        raise ValueError(f"the log-probability outputs ask for temperatures {spec.logprob_temperature} and "
                         f"{temperature}: a session has one logprob_temperature, ask for both at the same")
    spec.logprob_temperature = temperature


@dataclass(frozen=True)
class NextTokenLogprobs(Output):
    """Log-probabilities of the sequence's own next tokens: float32 [B, S], position t holding
    log p(x[t+1] | x[<=t]) at `temperature`.

    Positions without a next real token hold 0: the last position, and any position that is
    padding or followed by padding. Sent in float32 whatever the session's dtype: a bfloat16
    log-probability of -10 would be off by 0.03, and these are 4 bytes a token.
    """

    temperature: float = 1.0
    asked_as: ClassVar[str] = "next_token_logprobs"
    same_vocabulary: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "NextTokenLogprobs | None":
        return cls(spec.logprob_temperature or 1.0) if spec.next_token_logprobs else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.next_token_logprobs = True
        _temperature_to_spec(spec, self.temperature)

    def check(self, teacher: TeacherFacts) -> None:
        _check_temperature(self.temperature)

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(logits=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq), torch.float32)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        logits = forward.logits
        rows, seq = logits.shape[:2]
        values = torch.zeros(rows, seq, dtype=torch.float32, device=logits.device)
        if seq > 1:
            ids = _to_device(batch.input_ids, logits.device)
            real = _to_device(batch.attention_mask, logits.device).bool()
            scored = _logprobs_at(logits[:, :-1], ids[:, 1:, None], self.temperature)[..., 0]
            values[:, :-1] = torch.where(real[:, :-1] & real[:, 1:], scored, 0.0)
        return [values]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (values,) = tensors
        return {"next_token_logprobs": values}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.next_token_logprobs]

    def __str__(self) -> str:
        return f"next_token_logprobs(T={self.temperature:g})"


# Token ids the student sends travel as int32 (4 bytes an id): vocabularies are far below 2**31.
SCORE_ID_DTYPES = {"int32": np.int32}


@dataclass(frozen=True)
class ScoredLogprobs(Output):
    """Log-probabilities at ids the student sends with each batch: float32 [B, S, k], [b, t, j]
    holding log p(score_ids[b, t, j] | x[b, <=t]) at `temperature` (the student's own top k,
    say, which change every step). Padding positions hold 0.

    `k` is fixed for the session, at most the teacher's --max-score-ids; every batch sends
    int32 score_ids [B, S, k] in SubmitRequest.score_ids.
    """

    k: int
    temperature: float = 1.0
    asked_as: ClassVar[str] = "score_ids > 0"
    same_vocabulary: ClassVar[bool] = True
    batch_field: ClassVar[str] = "score_ids"

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "ScoredLogprobs | None":
        return cls(spec.score_ids, spec.logprob_temperature or 1.0) if spec.score_ids else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.score_ids = self.k
        _temperature_to_spec(spec, self.temperature)

    def check(self, teacher: TeacherFacts) -> None:
        if self.k < 0:
            raise OutputSpecError(f"score_ids {self.k} must be > 0 (ids scored per position; 0 asks for none)")
        if self.k > teacher.max_score_ids:
            raise OutputSpecError(f"score_ids {self.k} exceeds the teacher's --max-score-ids {teacher.max_score_ids}: "
                                  "score fewer ids per position, or start the teacher with a larger --max-score-ids")
        _check_temperature(self.temperature)

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(logits=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, self.k), torch.float32)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        logits = forward.logits
        ids = _to_device(batch.data[self.batch_field], logits.device)
        real = _to_device(batch.attention_mask, logits.device).bool()
        values = _logprobs_at(logits, ids, self.temperature)
        return [torch.where(real[..., None], values, 0.0)]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (values,) = tensors
        return {"scored_logprobs": values}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.scored_logprobs]

    def _expected_shape(self, batch: int, seq: int) -> list[int]:
        return [batch, seq, self.k]

    def write_batch(self, value: torch.Tensor, batch: int, seq: int, teacher: TeacherFacts) -> pb.Tensor:
        if list(value.shape) != self._expected_shape(batch, seq):
            raise ValueError(f"score_ids has shape {list(value.shape)}; it must be {self._expected_shape(batch, seq)}: "
                             f"the [batch, seq] of input_ids and the k = {self.k} ids per position asked at join")
        if value.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"score_ids must be token ids (int32 or int64), got {value.dtype}")
        # Before the cast to int32, which would wrap an id of 2**32 + 3 into the vocabulary as 3.
        low, high = int(value.min()), int(value.max())
        if low < 0 or high >= teacher.vocab_size:
            raise ValueError(f"score_ids must lie in [0, {teacher.vocab_size}) (the teacher's vocabulary), got values "
                             f"in [{low}, {high}]: padding positions need valid ids too (0 will do)")
        return wire.encode(value.to(torch.int32))

    def read_batch(self, tensor: pb.Tensor, batch: int, seq: int, teacher: TeacherFacts) -> torch.Tensor:
        shape, expected = list(tensor.shape), self._expected_shape(batch, seq)
        if shape != expected:
            raise BatchDataError(f"score_ids has shape {shape}; it must be {expected}: the [batch, seq] of input_ids "
                                 f"and the k = {self.k} ids per position this session asked for at join")
        try:
            ids = wire.decode_ids(tensor, what="score_ids", dtypes=SCORE_ID_DTYPES, max_elements=batch * seq * self.k)
        except wire.WireError as e:
            raise BatchDataError(str(e)) from e
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= teacher.vocab_size:
            raise BatchDataError(f"score_ids must lie in [0, {teacher.vocab_size}) (the teacher's vocabulary), got "
                                 f"values in [{low}, {high}]: padding positions need valid ids too (0 will do)")
        return torch.from_numpy(ids)

    def __str__(self) -> str:
        return f"score_ids={self.k}(T={self.temperature:g})"


# ---- cross-tokenizer kinds: shaped to the student's tokens (distill_common/alignment.py) ---------

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


def _aligned_probs(logits: torch.Tensor, context: torch.Tensor):
    """The positions whose context a teacher position ends exactly, and the teacher's next-token
    probabilities there in float32 chunks: yields (rows, cols, probs [n, V]) over the valid positions."""
    rows, cols = (context >= 0).nonzero(as_tuple=True)
    vocab = logits.shape[-1]
    step = max(1, _LOGPROB_CHUNK_BYTES // (4 * vocab))
    for start in range(0, len(rows), step):
        r, c = rows[start:start + step], cols[start:start + step]
        yield r, c, torch.softmax(logits[r, context[r, c]].float(), dim=-1)


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
        column = _to_device(torch.from_numpy(aligned.match.teacher_column), device)
        projected = torch.zeros(rows, seq, matched + 1, dtype=torch.float32, device=device)
        rest = torch.zeros(rows, seq, self.rest_topk, dtype=torch.float32, device=device)
        context = _to_device(aligned.context, device)
        for r, c, probs in _aligned_probs(logits, context):
            projected[r, c] = torch.zeros(len(r), matched + 1, dtype=torch.float32, device=device).index_add_(
                1, column, probs)
            if self.rest_topk:
                rest[r, c] = probs.masked_fill(column != matched, 0.0).topk(self.rest_topk, dim=-1).values
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

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (values,) = tensors
        return {"sorted_probs": values}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [out.sorted_probs]

    def __str__(self) -> str:
        return f"sorted_topk={self.k}"


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

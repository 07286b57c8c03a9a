"""The machinery every output kind shares: what a teacher says of itself (`TeacherFacts`), what a
forward produces (`BatchOutputs`), what a student receives (`TeacherOutput`), what crosses once at
join (`JoinData`), the errors, and the kind's interface (`Output`; the package's docstring says how
the pieces meet)."""

from __future__ import annotations

import abc
import functools
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import ClassVar, NamedTuple

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


class _InfoMirror:
    """A frozen dataclass whose fields are those of a TeacherInfo part (`info`), one for one and
    of the same scalar types, so that each converts to the other field by field."""

    info: ClassVar[type]

    @classmethod
    def from_info(cls, info):
        return cls(**{f.name: getattr(info, f.name) for f in fields(cls)})

    def to_info(self):
        return self.info(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True)
class HeadFacts(_InfoMirror):
    """The teacher's output head as TeacherInfo.head describes it: logits =
    softcap(logit_scale * (h W^T + b)); `unavailable` says why the student cannot apply it."""

    info: ClassVar[type] = pb.OutputHeadInfo
    bias: bool = False
    final_logit_softcapping: float = 0.0
    logit_scale: float = 1.0
    unavailable: str = _NOT_REPORTED


@dataclass(frozen=True)
class AttentionFacts(_InfoMirror):
    """The widths of one layer's attention inputs (TeacherInfo.attention); `unavailable` says
    why the teacher cannot send them."""

    info: ClassVar[type] = pb.AttentionInputsInfo
    query_width: int = 0
    key_width: int = 0
    value_width: int = 0
    unavailable: str = _NOT_REPORTED


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
    """One kind of teacher output (see the package's docstring). Subclasses are frozen dataclasses."""

    # How to ask for it, for the message that says nothing was asked.
    asked_as: ClassVar[str]
    # Whether it only means something to a student with the teacher's vocabulary.
    same_vocabulary: ClassVar[bool] = False
    # The SubmitRequest field it reads with every batch ("": none); see the package's docstring.
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

    # The TeacherOutput fields this kind's tensors fill, one each, in send order. A kind whose
    # tensors map to its fields otherwise (a dict per layer, a dtype changed) overrides
    # `assemble` and `disassemble` instead.
    fields: ClassVar[tuple[str, ...]] = ()

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        """The TeacherOutput fields this kind fills from its received tensors."""
        if not self.fields or len(tensors) != len(self.fields):
            raise NotImplementedError(f"{type(self).__name__}: {len(tensors)} tensors for the fields "
                                      f"{self.fields}; name them in `fields` or override assemble")
        return dict(zip(self.fields, tensors))

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        """The inverse of `assemble`: this kind's tensors, as `layout` says, from a TeacherOutput
        (what a store of teacher outputs keeps of it, student_trainer/store/)."""
        if not self.fields:
            raise NotImplementedError(f"{type(self).__name__}: name its fields in `fields` or override disassemble")
        return [getattr(out, name) for name in self.fields]

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


def _few(ids: list[int], shown: int = 8) -> str:
    """A list of ids for a message: the first few and how many more."""
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"{ids[:shown]}{more}"

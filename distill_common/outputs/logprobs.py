"""Log-probability kinds for on-policy distillation (`NextTokenLogprobs`, `ScoredLogprobs`), and
the chunked log-softmax and temperature checks they share with `TopK` and the cross-tokenizer kinds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from distill_common import wire
from distill_common.outputs.base import (BatchDataError, BatchOutputs, ForwardNeeds, Output, OutputSpecError,
                                         TeacherFacts, TensorSpec)
from distill_common.proto.teacher.v1 import teacher_pb2 as pb


def _logprobs_at(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) gathered at `ids`: float32 [B, S, k] from logits
    [B, S, V] and int64 ids [B, S, k].

    Row chunks of float32 (`rows_per_chunk`): a bfloat16 forward of 16k tokens over a 128k
    vocabulary would otherwise need an 8 GB float32 copy next to its logits.
    """
    batch, seq, vocab = logits.shape
    k = ids.shape[-1]
    rows, index = logits.reshape(batch * seq, vocab), ids.reshape(batch * seq, k)
    values = torch.empty(batch * seq, k, dtype=torch.float32, device=logits.device)
    step = rows_per_chunk(vocab, logits.device)
    for start in range(0, batch * seq, step):
        scaled = rows[start:start + step].float()
        if temperature != 1.0:
            scaled = scaled / temperature
        values[start:start + step] = scaled.gather(1, index[start:start + step]) - scaled.logsumexp(1, keepdim=True)
    return values.view(batch, seq, k)


_LOGPROB_CHUNK_BYTES = 256 << 20
# On a CPU running torch on one thread, chunks that stay in its caches: the several passes over a
# chunk (log-sum-exp, top-k, ranks) then read memory once. Measured on 2 cores (a [4096, 32,000]
# float32 derive of the HTTP API's log-probabilities, k = 20, bench/openai_logprobs.py's fourth
# table): one thread, 256 MiB chunks 1.81 s, 4 MiB 0.60 s; two threads 1.84 s and 1.83 s, and
# under load small chunks were slower there (each op's threads then split a small chunk and wait
# on each other), so with several threads chunks stay large.
_CPU_CHUNK_BYTES = 4 << 20


def rows_per_chunk(vocab: int, device: torch.device, element_bytes: int = 4) -> int:
    """Rows of `vocab` entries of `element_bytes` per chunk of a pass over logits on `device`."""
    limit = _LOGPROB_CHUNK_BYTES
    if device.type == "cpu" and torch.get_num_threads() == 1:
        limit = min(limit, _CPU_CHUNK_BYTES)
    return max(1, limit // (element_bytes * vocab))


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
    fields: ClassVar[tuple[str, ...]] = ("next_token_logprobs",)
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
    fields: ClassVar[tuple[str, ...]] = ("scored_logprobs",)
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

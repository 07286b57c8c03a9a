"""What a completions request asks of a forward: one kind, derived on the teacher's device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from distill_common.outputs.base import BatchOutputs, ForwardNeeds, Output, TeacherFacts, TensorSpec
from distill_common.outputs.logprobs import _to_device, rows_per_chunk

# The data a batch carries for it: [B, S, m] int64 ids to score at each position (-1: none).
SCORE_IDS = "prompt_logprob_token_ids"
# A chunk of a longer prompt also carries [B, S] int64: the prompt token after each of its
# positions (its last position's is the next chunk's first token).
NEXT_IDS = "next_ids"


@dataclass(frozen=True)
class CompletionLogprobs(Output):
    """For a [B, S] batch of right-padded prompts, in float32 at `temperature`:

    - `prompt_k` >= 0: the k largest log-probabilities at each position and their ids [B, S, k]
      (int64), the log-probability of the next prompt token [B, S] and its rank [B, S] (int64:
      1 + how many ids have a larger log-probability, vLLM's count `(x >= x[token]).sum()`);
      position t is about token t + 1 (`batch.data[NEXT_IDS]` when the batch has it: a chunk
      of a longer prompt; the last position's are zeros otherwise).
    - `scored` (m > 0): the log-probabilities at the ids `batch.data[SCORE_IDS]` [B, S, m]
      (-inf where an id is -1).
    - `last`: the whole log-softmax at each row's last real position [B, V], at temperature 1
      (what the next token is sampled from, and its log-probabilities reported).

    Never on the wire: the HTTP handler builds it (jobs.py); from_spec is never true.
    """

    prompt_k: int = -1  # -1: no prompt log-probabilities
    scored: int = 0
    last: bool = True
    temperature: float = 1.0
    asked_as: ClassVar[str] = "POST /v1/completions"
    same_vocabulary: ClassVar[bool] = True
    batch_field: ClassVar[str] = SCORE_IDS  # derived for each batch itself: never shared between requests

    @classmethod
    def from_spec(cls, spec) -> None:
        return None

    def to_spec(self, spec) -> None:
        raise TypeError("CompletionLogprobs is asked for over HTTP, never in an OutputSpec")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(logits=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        specs = []
        if self.prompt_k >= 0:
            specs += [TensorSpec((batch, seq, self.prompt_k), torch.float32),
                      TensorSpec((batch, seq, self.prompt_k), torch.int64),
                      TensorSpec((batch, seq), torch.float32), TensorSpec((batch, seq), torch.int64)]
        if self.scored:
            specs.append(TensorSpec((batch, seq, self.scored), torch.float32))
        if self.last:
            specs.append(TensorSpec((batch, teacher.vocab_size), torch.float32))
        return specs

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        logits = forward.logits
        rows, seq, vocab = logits.shape
        device = logits.device
        ids = _to_device(batch.input_ids, device)
        nxt = (_to_device(batch.data[NEXT_IDS], device) if NEXT_IDS in batch.data
               else torch.cat([ids[:, 1:], ids[:, -1:]], dim=1))  # the last column's is never read
        nxt = nxt.reshape(-1, 1)
        tensors = []
        if self.prompt_k >= 0 or self.scored:
            k = self.prompt_k if self.prompt_k >= 0 else 0
            top = torch.zeros(rows, seq, k, dtype=torch.float32, device=device)
            top_ids = torch.zeros(rows, seq, k, dtype=torch.int64, device=device)
            own = torch.zeros(rows, seq, dtype=torch.float32, device=device)
            rank = torch.zeros(rows, seq, dtype=torch.int64, device=device)
            scored = torch.zeros(rows, seq, self.scored, dtype=torch.float32, device=device)
            score_ids = _to_device(batch.data[SCORE_IDS], device) if self.scored else None
            flat = logits.reshape(rows * seq, vocab)
            step = rows_per_chunk(vocab, device)
            for start in range(0, rows * seq, step):
                part = slice(start, start + step)
                logprobs = flat[part].float()
                if self.temperature != 1.0:
                    logprobs = logprobs / self.temperature
                logprobs = logprobs - logprobs.logsumexp(1, keepdim=True)
                if k:
                    values, indices = logprobs.topk(k, dim=1)
                    top.view(-1, k)[part], top_ids.view(-1, k)[part] = values, indices
                mine = logprobs.gather(1, nxt[part])
                own.view(-1)[part] = mine[:, 0]
                rank.view(-1)[part] = (logprobs >= mine).sum(1)
                if self.scored:
                    chosen = score_ids.reshape(rows * seq, -1)[part]
                    got = logprobs.gather(1, chosen.clamp_min(0))
                    scored.view(-1, self.scored)[part] = got.masked_fill(chosen < 0, float("-inf"))
                del logprobs
            if self.prompt_k >= 0:
                tensors += [top, top_ids, own, rank]
            if self.scored:
                tensors.append(scored)
        if self.last:
            mask = _to_device(batch.attention_mask, device)
            last = mask.sum(1) - 1
            tensors.append(torch.log_softmax(logits[torch.arange(rows, device=device), last].float(), dim=-1))
        return tensors

    def __str__(self) -> str:
        return f"completion_logprobs(prompt_k={self.prompt_k}, scored={self.scored}, T={self.temperature:g})"

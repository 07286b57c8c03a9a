"""What the teacher knows of one student session, and of one batch it submitted.

Glossary: a *job* is a student training run (one or more processes); a *session*
is one process of that job joined to the teacher, with its own process group.
"""

from __future__ import annotations

import functools
import secrets
import time
from dataclasses import dataclass, field

import torch

from distill_common.outputs import OutputRequest
from teacher_server.cache import batch_key


@dataclass
class Batch:
    batch_id: int
    input_ids: torch.Tensor  # [B, S] int64, CPU
    attention_mask: torch.Tensor  # [B, S] int64, CPU
    # What the session's output kinds read with the batch, by SubmitRequest field (score_ids: [B, S, k]).
    data: dict[str, torch.Tensor] = field(default_factory=dict)

    @functools.cached_property
    def key(self) -> bytes:
        """Content digest (teacher_server.cache.batch_key): identical batches share work.

        Of the forward's inputs only: batches that differ in `data` alone share their forward
        (delivery derives each one's outputs for itself).

        Computed when the engine first plans the batch, on its thread, not in the gRPC
        handler that queues it."""
        return batch_key(self.input_ids, self.attention_mask)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


@dataclass
class Session:
    job_id: str
    job_rank: int
    outputs: OutputRequest  # what it asked for at join, resolved against this teacher
    backend: str
    peer_device_type: str
    max_inflight: int
    weight: float
    # SubmitStream answers only refused batches (JoinRequest.stream_refusals_only).
    stream_refusals_only: bool = False
    session_id: str = field(default_factory=lambda: secrets.token_hex(8))
    # Only the admitted student learns the prefix, so only it can form the group.
    store_prefix: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    state: str = "connecting"  # connecting -> ready -> draining -> closed | failed
    next_batch_id: int = 0
    batches_submitted: int = 0
    batches_sent: int = 0
    tokens_served: int = 0
    bytes_sent: int = 0
    last_heartbeat: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.monotonic)
    failure: str = ""

    @property
    def inflight(self) -> int:
        """Batches submitted whose outputs have not finished sending."""
        return self.batches_submitted - self.batches_sent

    @property
    def alive(self) -> bool:
        return self.state in ("connecting", "ready", "draining")

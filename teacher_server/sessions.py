"""What the teacher knows of one student session, and of one batch it submitted.

Glossary: a *job* is a student training run (one or more processes); a *session*
is one process of that job joined to the teacher, with its own process group.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from dataclasses import dataclass, field

import torch

from distill_common.alignment import StudentVocabulary, VocabularyMatch
from distill_common.announcements import Outbox
from distill_common.outputs import OutputRequest
from distill_common.rendezvous import SessionStore
from distill_common.wire import batch_key


@dataclass
class Batch:
    batch_id: int
    input_ids: torch.Tensor  # [B, S] int64, CPU
    attention_mask: torch.Tensor  # [B, S] int64, CPU
    # What the session's output kinds read with the batch, by SubmitRequest field (score_ids: [B, S, k]).
    data: dict[str, torch.Tensor] = field(default_factory=dict, compare=False)
    # Handed to delivery (its sends posted, or failed): its student hears of it once.
    handed: bool = field(default=False, compare=False)
    # A batch the teacher re-tokenized (a cross-tokenizer session): the shape of the ids the student
    # sent, which its outputs are shaped to, and their digest, which its header names.
    student_shape: tuple[int, int] | None = field(default=None, compare=False)
    student_key: bytes | None = field(default=None, compare=False)
    # What its outputs take in teacher memory until the student has them (the scheduler's budget).
    output_bytes: int = field(default=0, compare=False)
    # Runs in a forward of its own (an HTTP API batch: packed with a student's, both would be padded
    # to the longer, and another job's batch would wait for the sum); identical ones still share.
    alone: bool = field(default=False, compare=False)
    # A chunk of a longer sequence, run after the chunks before it on their KV cache
    # (model_runner.Chunk): alone, never shared or cached, its key its own.
    chunk: object = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def key(self) -> bytes:
        """Content digest (distill_common.wire.batch_key): identical batches share work, and
        its first 16 bytes go in the batch's header on the data plane.

        Of the forward's inputs only: batches that differ in `data` alone share their forward
        (delivery derives each one's outputs for itself).

        Computed when the engine first plans the batch, on its thread, not in the gRPC
        handler that queues it. A chunk's outputs depend on the chunks before it: its key is
        random, so nothing shares them."""
        if self.chunk is not None:
            return secrets.token_bytes(32)
        return batch_key(self.input_ids, self.attention_mask)

    @property
    def layout_shape(self) -> tuple[int, int]:
        """The [rows, seq] its outputs are shaped to: the student's ids, re-tokenized or not."""
        return self.student_shape or (self.rows, self.seq_len)

    @property
    def header_key(self) -> bytes:
        """The digest its header names: of the ids the student sent."""
        return self.student_key or self.key

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


@dataclass(frozen=True)
class SessionAlignment:
    """What a cross-tokenizer session's batches are aligned with: the student's vocabulary (from its
    Join) and which of its pieces the teacher's vocabulary spells."""

    vocabulary: StudentVocabulary
    match: VocabularyMatch


@dataclass
class Session:
    job_id: str
    job_rank: int
    outputs: OutputRequest  # what it asked for at join, resolved against this teacher
    backend: str
    peer_device_type: str
    max_inflight: int
    weight: float
    # The session's rendezvous keys (distill_common/rendezvous.py): its group forms on them,
    # and only calls with the session's secret (the student's Join answer) reach them.
    rendezvous: SessionStore
    # SubmitStream answers only refused batches (JoinRequest.stream_refusals_only).
    stream_refusals_only: bool = False
    # A cross-tokenizer session's vocabulary and its match with the teacher's (None: same tokenizer).
    alignment: "SessionAlignment | None" = None
    # Its re-tokenized batches reach the engine in submit order (TeacherService._submit).
    submit_order: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    # Its batches accepted and not yet re-tokenized: they count against max_inflight as queued ones do.
    retokenizing: int = 0
    # The job's sessions over every replica of a pool (JoinRequest.job_size; 0: unknown): the
    # scheduler applies its weight in proportion to its sessions here.
    job_size: int = 0
    # An HTTP API session (teacher_server/openai/jobs.py): the end of its "group" that hands its
    # outputs to the waiting request in this process; None for a student's session.
    local_group: object = field(default=None, repr=False)
    session_id: str = field(default_factory=lambda: secrets.token_hex(8))
    # The capability: every call about the session must carry it (TeacherService.session_for),
    # and the student proves it over the formed group (session_group.handshake). The id is not
    # one: status and metrics show it. 256 bits, kept out of reprs and logs.
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    # What became of its batches, for its submit stream (distill_common/announcements.py).
    outbox: Outbox = field(default_factory=Outbox)
    state: str = "connecting"  # connecting -> ready -> draining -> closed | failed
    next_batch_id: int = 0
    batches_submitted: int = 0
    batches_sent: int = 0
    batches_failed: int = 0  # accepted, never sent (Delivery.fail)
    tokens_served: int = 0
    bytes_sent: int = 0
    last_heartbeat: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.monotonic)
    failure: str = ""

    @property
    def inflight(self) -> int:
        """Batches submitted whose outputs have not finished sending (nor failed)."""
        return self.batches_submitted - self.batches_sent - self.batches_failed

    @property
    def alive(self) -> bool:
        return self.state in ("connecting", "ready", "draining")

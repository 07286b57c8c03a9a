"""The bounds the teacher enforces, derived from its settings and from the model it serves.

A setting left at 0 (--max-request-bytes, --max-streams, --max-rpcs, --max-job-rpcs,
--max-output-bytes, --max-held-bytes, --max-student-vocab, --max-seq-len) takes its value
from the others and from the model's facts; the edge (teacher_server/edge.py), the join's
checks (teacher_server/joining.py) and the scheduler read the resolved values here, so a
default is computed in one place. `ServerConfig` inherits these: a caller asks
`config.rpcs_limit` as it asks `config.max_rpcs`.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from distill_common.settings import ConfigError

if TYPE_CHECKING:  # torch is imported after the flags are checked
    from distill_common.models import PositionLimit
    from distill_common.outputs import TeacherFacts


# --max-seq-len for a model whose positions have no hard limit (rotary, ALiBi).
DEFAULT_MAX_SEQ_LEN = 8192

# The default --max-held-bytes takes at most this share of the memory available where the
# outputs are held, once the model is loaded: the rest is left to the forward's activations,
# the transport's copies and the host's other work, so students that stop receiving cannot
# make the teacher run out of memory.
HELD_MEMORY_SHARE = 0.25


def available_memory_bytes(device: str) -> int:
    """Memory free for new allocations on `device` (cpu, cuda, cuda:N), where the teacher's
    outputs are held: the GPU's free memory, or the host's MemAvailable (/proc/meminfo; the
    free physical pages where there is no such file)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kiB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ServerLimits:
    """The derived bounds of `teacher_server.config.ServerConfig`, whose settings they read."""

    # The model's hard limit on sequence length (a distill_common.models.PositionLimit), set by
    # fit_model; None: it has none. Not annotated: not a setting.
    position_limit = None
    # The model's vocabulary size, set by fit_model (0: unknown). Not a setting either.
    model_vocab_size = 0

    def fit_model(self, limit: PositionLimit | None, vocab_size: int = 0) -> None:
        """Fits --max-seq-len to the model's hard limit on sequence length (None: it has none),
        and the default request size to its vocabulary (`vocab_size`, 0: unknown).

        Called at start-up, before the weights load: a longer --max-seq-len is refused, and 0
        becomes the limit (or DEFAULT_MAX_SEQ_LEN), at most --max-batch-tokens. `position_limit`
        keeps the limit for the messages that refuse a batch.
        """
        self.position_limit = limit
        self.model_vocab_size = vocab_size
        if limit is not None and self.max_seq_len > limit.positions:
            raise ConfigError(f"--max-seq-len {self.max_seq_len} is longer than the model can run: {limit}. Use "
                              f"--max-seq-len {limit.positions} or less, or leave it out")
        if not self.max_seq_len:
            self.max_seq_len = min(limit.positions if limit is not None else DEFAULT_MAX_SEQ_LEN,
                                   self.max_batch_tokens)

    def output_bytes_limit(self, teacher: TeacherFacts) -> int:
        """--max-output-bytes, or by default the most the per-token kinds can ask of a batch of
        --max-batch-tokens tokens: full logits, top-k of --max-topk (values and int32 indices),
        every hidden state, the next token's log-probability and --max-score-ids scored ids, all
        in float32. Kinds that grow faster than the tokens (per pair of positions, say) are
        bounded by it too."""
        if self.max_output_bytes:
            return self.max_output_bytes
        topk = min(self.max_topk or teacher.vocab_size, teacher.vocab_size)
        per_token = (teacher.vocab_size + 2 * topk + (teacher.num_layers + 1) * teacher.hidden_size
                     + 1 + self.max_score_ids)
        return self.max_batch_tokens * per_token * 4

    def largest_batches(self) -> tuple[tuple[int, int], ...]:
        """The [rows, seq] batches --max-output-bytes is checked against: the longest sequences
        (as many of --max-seq-len as --max-batch-tokens holds: where outputs that grow faster than
        the sequence are largest) and the most tokens in the longest sequences that make them up
        exactly (where outputs per token are: a --max-seq-len that does not divide
        --max-batch-tokens leaves up to half of it out of the first)."""
        tokens = self.max_batch_tokens
        divisors = {d for small in range(1, math.isqrt(tokens) + 1) if tokens % small == 0
                    for d in (small, tokens // small)}
        seq = max(d for d in divisors if d <= self.max_seq_len)
        return (self.max_batch_tokens // self.max_seq_len, self.max_seq_len), (self.max_batch_tokens // seq, seq)

    @property
    def full_batch_bytes(self) -> int:
        """A request carrying a full batch: int64 ids and mask (the widest the wire allows) and
        --max-score-ids int32 ids to score per token, plus 64 KiB for framing, which also covers
        every other message."""
        return (2 * 8 + 4 * self.max_score_ids) * self.max_batch_tokens + (64 << 10)

    @property
    def full_join_bytes(self) -> int:
        """The largest Join a session may need, plus the same 64 KiB of framing: one asking for logits
        over the whole vocabulary as a subset (int64 ids, the widest the wire allows), or one sending a
        student vocabulary of --max-student-vocab entries (12 bytes of pieces each on average, and each
        length as a varint of up to 2 bytes)."""
        from distill_common.alignment import VOCABULARY_BYTES_PER_ENTRY  # torch comes with it: not at flag parsing

        student_vocabulary = (VOCABULARY_BYTES_PER_ENTRY + 2) * self.student_vocab_limit  # pieces, varint lengths
        return max(8 * self.model_vocab_size, student_vocabulary) + (64 << 10)

    @property
    def student_vocab_limit(self) -> int:
        """--max-student-vocab resolved: the entries a cross-tokenizer student's vocabulary may have."""
        return self.max_student_vocab or self.model_vocab_size

    @property
    def request_limit_bytes(self) -> int:
        return self.max_request_bytes or max(self.full_batch_bytes, self.full_join_bytes)

    @property
    def streams_limit(self) -> int:
        return self.max_streams or 2 * self.max_sessions

    @property
    def rpcs_limit(self) -> int:
        return self.max_rpcs or 4 * self.max_sessions + 16

    def job_rpcs_limit(self, job_sessions: int) -> int:
        """Calls one job may have in progress (each of its budgets): --max-job-rpcs, or what
        `job_sessions` sessions need (0: as many as --max-sessions), at most --max-rpcs."""
        return min(self.max_job_rpcs or 4 * (job_sessions or self.max_sessions) + 16, self.rpcs_limit)

    def job_streams_limit(self, job_sessions: int) -> int:
        """Streams one job may have open: two per session it may hold (one more while a
        reconnecting student's old stream ends), at most --max-streams."""
        return min(2 * (job_sessions or self.max_sessions), self.streams_limit)

    def held_bytes_limit(self, teacher: TeacherFacts, available_bytes: int) -> int:
        """--max-held-bytes, or by default --max-inflight batches of the largest outputs, at most
        HELD_MEMORY_SHARE of `available_bytes` (the memory available where they are held)."""
        if self.max_held_bytes:
            return self.max_held_bytes
        return min(self.max_inflight * self.output_bytes_limit(teacher), int(HELD_MEMORY_SHARE * available_bytes))

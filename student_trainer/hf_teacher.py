"""The teacher's side of `student_trainer.hf.DistillationTrainer`: one source of teacher outputs
per process, joined the first time a micro-batch needs it, and the prefetch of an optimizer
step's micro-batches.

The source is a `TeacherClient` of a live teacher, or a store of its outputs
(`student_trainer.store`) that the live teacher, where there is one, fills. The Trainer draws an
optimizer step's micro-batches before training them (`get_batch_samples`): `step` queues them,
and `future` submits micro-batch i + 1 when micro-batch i starts, so that the teacher works while
the student trains. At most two micro-batches of teacher outputs are held at once.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import KW_ONLY, dataclass, field

import torch

from distill_common.outputs import TeacherOutput
from student_trainer.client import TeacherClient
from student_trainer.errors import TeacherUnavailable

log = logging.getLogger(__name__)

# Micro-batches submitted to the teacher beyond the one training: enough to hide the
# teacher's forward behind the student's step, while only two batches of [B, S, V]
# teacher logits are alive on the device.
PREFETCH_MICRO_BATCHES = 1

# The TeacherClient arguments the feed sets itself: the trainer's own arguments say them.
FEED_CLIENT_ARGUMENTS = frozenset({"address", "device", "outputs", "tokenizer", "vocab_size", "max_inflight",
                                   "job_id", "job_rank", "auth_token", "join_timeout_s", "transfer_timeout_s"})


@dataclass(eq=False)
class TeacherFeed:
    """Teacher outputs for the micro-batches of a Trainer's steps, in the order it trains them."""

    address: str | None  # host:port of a live teacher (None: the store alone)
    store: str | None  # a directory of the teacher's outputs (None: the live teacher alone)
    outputs: tuple  # the kinds asked for
    _: KW_ONLY
    # This process's part of the job, told to the teacher at join.
    device: torch.device | str
    job_id: str
    job_rank: int
    tokenizer: object
    vocab_size: int
    timeout_s: float  # the longest wait to join and for one batch's outputs
    auth_token: str | None = field(repr=False)  # a secret: kept out of reprs
    client_options: dict  # more keyword arguments of TeacherClient
    summary: str  # what this rank distils, for the log line at join
    teacher: object = field(default=None, init=False)  # the source once joined: a TeacherClient or a StoreTeacher
    # This step's micro-batches not yet submitted, and those submitted: (input_ids, future).
    _upcoming: deque[dict] = field(default_factory=deque, init=False)
    _inflight: deque[tuple[torch.Tensor, Future]] = field(default_factory=deque, init=False)

    def step(self, batch_samples: list[dict]) -> None:
        """The micro-batches of the next optimizer step, which the Trainer trains next, in this
        order; the previous step's have all been consumed by now."""
        self._inflight.clear()
        self._upcoming = deque(batch_samples)
        self._submit_until(1)

    def future(self, inputs: dict, from_prefetch: bool) -> Future:
        """The future of the teacher's outputs for `inputs`: the prefetched one in training."""
        if from_prefetch:
            self._submit_until(1)
        if not (from_prefetch and self._inflight):
            return self._submit(inputs)  # evaluation, or a call from outside the Trainer's loop
        queued_ids, future = self._inflight.popleft()
        input_ids = inputs["input_ids"]
        if not (queued_ids is input_ids or (queued_ids.shape == input_ids.shape
                                            and torch.equal(queued_ids.to(input_ids.device), input_ids))):
            raise RuntimeError(
                "the micro-batch in compute_loss is not the one the Trainer drew for this step, so the teacher's "
                "outputs would be for other tokens. Something between get_batch_samples and compute_loss changed "
                "input_ids; context and sequence parallelism do (they shard sequences, and the teacher must see "
                "them whole): they are not supported with DistillationTrainer")
        self._submit_until(PREFETCH_MICRO_BATCHES)  # the teacher works on the next while this one trains
        return future

    def _submit_until(self, inflight: int) -> None:
        """Submits this step's next micro-batches until `inflight` are in flight or none is left."""
        while self._upcoming and len(self._inflight) < inflight:
            batch = self._upcoming.popleft()
            self._inflight.append((batch["input_ids"], self._submit(batch)))

    def _submit(self, batch: dict) -> Future:
        if "input_ids" not in batch:
            raise ValueError(f"DistillationTrainer sends the batch's input_ids to the teacher, but the batch has only "
                             f"{sorted(batch)}")
        return self.client(batch["input_ids"].shape[-1]).submit(
            batch["input_ids"], batch.get("attention_mask"), timeout_s=self.timeout_s)

    def wait(self, future: Future) -> TeacherOutput:
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise TeacherUnavailable(f"{self.teacher.address if self.teacher else self.address} sent no outputs for a "
                                     f"batch within {self.timeout_s:.0f}s: it is overloaded or stuck (see its log), "
                                     "or raise teacher_timeout_s") from None

    def client(self, seq_len: int | None = None):
        """The source of teacher outputs, joined on first use: a TeacherClient, or (a store) a
        StoreTeacher over the store, filled by the TeacherClient when there is one. `seq_len`: the
        first batch's, the length of a store's rows when the teacher creates it."""
        if self.teacher is not None:
            return self.teacher
        live = TeacherClient(
            self.address, self.device, outputs=self.outputs, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
            max_inflight=PREFETCH_MICRO_BATCHES + 1, job_id=self.job_id, job_rank=self.job_rank,
            auth_token=self.auth_token, join_timeout_s=self.timeout_s, transfer_timeout_s=self.timeout_s,
            **self.client_options) if self.address else None
        self.teacher = live
        if self.store:
            from student_trainer.store import open_store_teacher

            try:
                # Rows are found by their ids and mask: the batches must be those the store was
                # dumped from (fixed-length rows), or a teacher given to compute the others.
                self.teacher = open_store_teacher(
                    self.store, self.device, self.outputs, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                    teacher=live, model_name=live.info.model_name if live is not None else "", seq_len=seq_len,
                    timeout_s=self.timeout_s)
            except BaseException:
                if live is not None:
                    live.close()
                raise
        log.info("rank %d distils from %s (%s): %s", self.job_rank, self.teacher.address,
                 self.teacher.info.model_name, self.summary)
        return self.teacher

    def close(self) -> None:
        """Leaves the teacher session, if one is open (the next micro-batch joins again)."""
        self._upcoming.clear()
        self._inflight.clear()
        teacher, self.teacher = self.teacher, None
        if teacher is not None:
            teacher.close()

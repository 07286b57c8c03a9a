"""TeacherClient: how a training process gets the teacher's outputs.

    with TeacherClient("host:50051", device="cuda:1", outputs=(Logits(),)) as teacher:
        fut = teacher.submit(input_ids, attention_mask)   # returns at once
        out = fut.result(timeout=60)                       # TeacherOutput

Join tells the client every shape it will receive; what the kinds asked send once (the
teacher's output head, for FinalHidden) arrives on the session's group right after the
handshake, in `joined`. The session's group forms on the
session's rendezvous keys, which the client reads and writes over this same gRPC channel
(distill_common/rendezvous.py: the teacher opens no store port). `submit` puts a batch on
the session's submit stream and returns its future. Once the teacher announces the batch
on that stream (its outputs exist and its sends are posted), the client allocates the
output buffers and posts the receives, which the teacher's sends fill in submit order;
each batch's receives are waited for with a deadline, its header checked, and its
future resolved (student_trainer/session.py).
At most `max_inflight` batches are outstanding: `submit` blocks beyond that
(backpressure, not memory).

When the teacher goes away (UNAVAILABLE, a broken session group, NOT_FOUND for our
session after a restart) the client joins again, with backoff, for up to
`reconnect_timeout_s`, and sends the new session every batch whose outputs it has not
delivered, in submit order: each future resolves exactly once, later than it would
have; a batch that ended every session it was sent to, `max_resubmits` times again, fails
instead with why each ended. A refusal (INVALID_ARGUMENT, FAILED_PRECONDITION,
RESOURCE_EXHAUSTED, UNAUTHENTICATED, PERMISSION_DENIED) is final, but for a first Join
refused because the teacher is full (RESOURCE_EXHAUSTED), asked again until
`join_timeout_s`. What a failure leads to is decided in one place, the connection's state
machine (student_trainer/connection.py); joining, noticing a failure and joining again are
carried out by student_trainer/joining.py, on what it shares with the client: their `Link`
(student_trainer/link.py: the channel, the undelivered batches, the locks). Batch ids restart at 0 on every session (see
SubmitRequest.batch_id); `TeacherOutput.batch_id` is the client's own id, which does not.

Every call about a session carries the secret its Join returned (the gRPC metadata key
SESSION_SECRET_KEY): a session id alone lets nobody act on it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future

import grpc
import torch

from distill_common import tracing, wire
from distill_common.outputs import Logits, Output, OutputRequest, output_spec
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.session_group import device_uuid, nccl_version
from distill_common.alignment import StudentVocabulary, row_texts
from distill_common.vocab import tokenizer_fingerprint
from student_trainer import joining
from student_trainer.connection import MAX_RESUBMITS, Connection, FirstJoin, State
from student_trainer.errors import Incompatible, TeacherError, TeacherUnavailable
from student_trainer.link import Link, TeacherChannel, TeacherInfo
from student_trainer.pool import Pool
from student_trainer.session import Batch

log = logging.getLogger(__name__)


def _join_request(device: torch.device, spec, vocabulary: StudentVocabulary | None, fingerprint: str, *,
                  job_id: str | None, job_rank: int | None, max_inflight: int, vocab_size: int,
                  weight: float) -> pb.JoinRequest:
    """What every Join of the client asks, the first and each after a restart."""
    request = pb.JoinRequest(
        job_id=job_id or os.environ.get("TORCHELASTIC_RUN_ID", "") or f"pid{os.getpid()}",
        job_rank=int(os.environ.get("RANK", "0")) if job_rank is None else job_rank,
        outputs=spec,
        peer=pb.PeerInfo(device_type=device.type, device_uuid=device_uuid(device),
                         torch_version=torch.__version__,
                         nccl_version=nccl_version() if device.type == "cuda" else ""),
        max_inflight=max_inflight, tokenizer_fingerprint=fingerprint, stream_refusals_only=True,
        # The width of the student's logits (its output embedding's rows), which may
        # exceed len(tokenizer): models pad it. Without it, no size check is made.
        vocab_size=vocab_size, weight=weight)
    if vocabulary is not None:
        vocabulary.to_proto(request.student_vocabulary)
    return request


class TeacherClient:
    def __init__(self, address: str, device: str | torch.device = "cpu", *, outputs: Iterable[Output] = (Logits(),),
                 dtype: str | None = None, max_inflight: int = 0, job_id: str | None = None,
                 job_rank: int | None = None, job_size: int | None = None, tokenizer=None, vocab_size: int = 0,
                 weight: float = 1.0,
                 rpc_timeout_s: float = 30.0, auth_token: str | None = None,
                 join_timeout_s: float = 120.0, transfer_timeout_s: float | None = None,
                 tls_ca: str | bool | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 reconnect_timeout_s: float = 300.0, max_resubmits: int = MAX_RESUBMITS,
                 refuse_quantized: bool = False, max_teacher_kl: float = 0.0):
        """`outputs`: the kinds of teacher output to receive (distill_common.outputs: Logits(),
        TopK(k), HiddenStates(layers), NextTokenLogprobs(), ScoredLogprobs(k)), in `dtype`
        (None: the teacher's; TopK's log-probabilities too, NextTokenLogprobs' and ScoredLogprobs'
        are float32).

        `tls_ca`: talk TLS to a teacher started with --tls-cert, trusting this PEM CA bundle
        (True: the system's roots). `tls_cert`/`tls_key`: this client's certificate, for a
        teacher started with --tls-client-ca. The data plane is not encrypted either way.

        `reconnect_timeout_s`: how long to keep trying to join again after the teacher went
        away (a restart, a crash, a network cut) before failing the outstanding batches
        with TeacherUnavailable; 0 fails them at once. The default, 5 minutes, covers a
        restart that reloads a large model; a job that would rather fail fast lowers it.
        `max_resubmits`: how many times a batch is sent again after the session holding it
        ended; past that it fails with BatchNotServed, naming why each session ended.
        `address` may name a pool of replicas (a comma list, dns:NAME:PORT, file:PATH;
        student_trainer/pool.py): the session joins the one with most room and moves to another
        if it is lost. `job_size`: the job's ranks over the pool (default: WORLD_SIZE, else 0: unknown),
        so that its weight holds over the pool (only sent to a pool).
        `refuse_quantized`: refuse a teacher whose decoder runs in FP8 (TeacherInfo.quantization)
        at join, with Incompatible, for a student that must learn the full-precision distribution.
        `max_teacher_kl`: refuse, the same way, a quantized teacher whose start-up measurement of
        what quantization costs it (KL to its own dtype per token) is above this or missing (0: no bound)."""
        if not 0 <= max_teacher_kl < float("inf"):
            raise ValueError(f"--max-teacher-kl {max_teacher_kl} must be a finite number >= 0 (0: no bound)")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        token = os.environ.get("TEACHER_AUTH_TOKEN", "") if auth_token is None else auth_token
        # `address` may name a pool of replicas (student_trainer/pool.py): the session joins the one with most room.
        pool = Pool(address, lambda at: TeacherChannel(at, rpc_timeout_s, token, tls_ca=tls_ca, tls_cert=tls_cert,
                                                       tls_key=tls_key))
        self._next_batch_id = 0  # the client's own batch ids (see Batch.batch_id)

        fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""
        outputs = tuple(outputs)
        spec = output_spec(outputs, dtype)
        # A student with another tokenizer sends its vocabulary (the bytes of each id) once, and its text per batch.
        self.vocabulary: StudentVocabulary | None = None
        if any(kind.cross_tokenizer for kind in outputs):
            if tokenizer is None:
                raise ValueError("cross-tokenizer outputs need the student's tokenizer: pass tokenizer=")
            self.vocabulary = StudentVocabulary.of(tokenizer)
        join_request = _join_request(device, spec, self.vocabulary, fingerprint, job_id=job_id, job_rank=job_rank,
                                     max_inflight=max_inflight, vocab_size=vocab_size, weight=weight)
        if not pool.single:
            join_request.job_size = int(os.environ.get("WORLD_SIZE", "0")) if job_size is None else job_size
        first_join = FirstJoin(address, join_timeout_s,
                               student_vocab_entries=len(self.vocabulary.pieces) if self.vocabulary else 0)
        chosen, statuses = joining.choose_first(pool, join_request, first_join.deadline)
        channel = pool.channel(chosen)
        # What this client and its joining procedure (student_trainer/joining.py) share.
        self._link = link = Link(channel, device, join_request, join_timeout_s=join_timeout_s,
                                 reconnect_timeout_s=reconnect_timeout_s, transfer_timeout_s=transfer_timeout_s)
        link.pool = pool
        try:
            channel.wait_for_server(max(0.1, first_join.deadline - time.monotonic()))
        except BaseException:
            pool.close()
            raise
        joined = joining.join_first(link, first_join)
        if not pool.single:  # joins at the same moment as this one may have landed on the same replica
            joined, chosen = joining.settle(link, joined, chosen, first_join)
            channel = link.channel
        link.info = TeacherInfo.from_proto(joined.info)
        try:
            pool.check_same(chosen, joined.info, statuses)
        except Incompatible:
            channel.leave(joined)
            pool.close()
            raise
        if refuse_quantized and self.info.quantization.format:
            channel.leave(joined)
            pool.close()
            raise Incompatible(f"teacher {address} runs its decoder in {self.info.quantization}, and this student "
                               "refuses a quantized teacher (--refuse-fp8-teacher): serve the teacher without "
                               "--quantize and from a checkpoint in its full dtype, or drop the flag",
                               grpc.StatusCode.FAILED_PRECONDITION)
        refusal = self.info.quantization.above(max_teacher_kl) if max_teacher_kl else ""
        if refusal:
            channel.leave(joined)
            channel.close()
            raise Incompatible(f"teacher {address}: {refusal}, and this student's --max-teacher-kl is "
                               f"{max_teacher_kl:g}: serve the teacher with --fp8-max-kl {max_teacher_kl:g} (it keeps "
                               "its costliest linears in its dtype until its measured KL is under that), without "
                               "--quantize, or raise this student's bound", grpc.StatusCode.FAILED_PRECONDITION)
        link.backend = joined.backend
        self.max_inflight = joined.max_inflight
        link.output_dtype = wire.parse_output_dtype(joined.output_dtype)
        link.outputs = OutputRequest.granted(join_request.outputs, joined)
        link.matched_student_ids = joining.matched_student_ids(joined)
        link.transfer_timeout_s = transfer_timeout_s or joined.timeout_s
        link.heartbeat_interval_s = joined.heartbeat_interval_s
        self._slots = threading.Semaphore(self.max_inflight)
        # A join after a restart asks for what this one was granted: the slots are sized by it.
        join_request.max_inflight = self.max_inflight
        try:
            session = joining.connect(link, joined, join_timeout_s)
        except BaseException:
            channel.leave(joined)
            pool.close()
            raise
        link.joined = session.joined_data
        link.connection = Connection(session, address, reconnect_timeout_s, max_resubmits=max_resubmits)
        link.start(session)
        self._heartbeat_thread = threading.Thread(target=joining.send_heartbeats, args=(link,), name="send-heartbeats",
                                                  daemon=True)
        self._heartbeat_thread.start()
        log.info("joined teacher %s as session %s (%s, %s, %s; decoder linears: %s)", chosen, self.session_id,
                 self.backend, self.info.model_name, self.info.dtype,
                 self.info.quantization if self.info.quantization.format else f"{self.info.dtype}, not quantized")

    # ---- public ------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        """The current session's id (a new one after each reconnect)."""
        return self._connection.session.session_id

    # What the first Join granted, kept where the joining procedure checks a teacher that came back against it.
    address = property(lambda self: self._link.channel.address)
    device = property(lambda self: self._link.device)
    info = property(lambda self: self._link.info, doc="The teacher's model and limits (TeacherInfo).")
    backend = property(lambda self: self._link.backend, doc="The data plane's backend: nccl or gloo.")
    output_dtype = property(lambda self: self._link.output_dtype)
    outputs = property(lambda self: self._link.outputs, doc="What was granted (OutputRequest).")
    matched_student_ids = property(lambda self: self._link.matched_student_ids,
                                   doc="Cross-tokenizer outputs: the student ids of ProjectedNext's columns, "
                                       "int64 [M] (None otherwise).")
    joined = property(lambda self: self._link.joined,
                      doc="What the kinds asked sent once at join (TeacherOutput's companions: the output head).")
    rpc_timeout_s = property(lambda self: self._link.channel.rpc_timeout_s)
    join_timeout_s = property(lambda self: self._link.join_timeout_s)
    reconnect_timeout_s = property(lambda self: self._link.reconnect_timeout_s)
    transfer_timeout_s = property(lambda self: self._link.transfer_timeout_s)
    heartbeat_interval_s = property(lambda self: self._link.heartbeat_interval_s)
    reconnects = property(lambda self: self._link.reconnects, doc="Joins after the first, each after the teacher "
                                                                  "went away.")
    _connection = property(lambda self: self._link.connection)

    def submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               timeout_s: float | None = None, *, score_ids: torch.Tensor | None = None,
               student_text: list[bytes] | None = None) -> Future:
        """Registers a [B, S] batch; returns at once a Future of its TeacherOutput.

        `score_ids` [B, S, k]: the ids whose log-probabilities a session that asked for
        ScoredLogprobs(k) wants at each position (required then, refused otherwise).
        `student_text`: for cross-tokenizer outputs, the bytes each row's real tokens spell
        (default: made from the ids and the tokenizer's vocabulary).

        The batch is put on the session's submit stream; its receives are posted by the
        session's own threads once the teacher announces it, so a training loop never
        waits on the control plane or the data plane here. A refusal by the teacher (bad
        ids, a limit) is raised by the future's result(); malformed tensors are refused
        here. Blocks while max_inflight batches are outstanding, at most `timeout_s`
        (default: the transfer timeout); time spent reconnecting does not count.
        """
        self._check_usable()
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {list(attention_mask.shape)} differs from input_ids "
                             f"{list(input_ids.shape)}")
        # Encoded now: the caller may reuse its tensors as soon as submit returns.
        request = pb.SubmitRequest(input_ids=wire.encode(input_ids))
        if attention_mask is not None:
            request.attention_mask.CopyFrom(wire.encode(attention_mask))
        if self.vocabulary is not None and student_text is None:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            student_text = row_texts(input_ids, mask, self.vocabulary)
        self.outputs.write_batch(request, *input_ids.shape, score_ids=score_ids, student_text=student_text)
        wait_s = self.transfer_timeout_s if timeout_s is None else timeout_s
        tracing.mark("s_submit", self._next_batch_id)
        self._acquire_slot(wait_s)
        future: Future = Future()
        future.add_done_callback(lambda _: self._slots.release())
        with self._link.submit_lock:
            with self._link.cond:
                error = self._connection.unusable()
                if error is None:
                    batch = Batch(self._next_batch_id, tuple(input_ids.shape), request, future)
                    self._next_batch_id += 1
                    self._link.undelivered[batch.batch_id] = batch
                    session = self._connection.current()
            if error is not None:
                future.set_exception(error)  # frees the slot
                raise error
            if session is not None:  # else a reconnect is under way: it sends the batch to the new session
                session.send(batch)
        return future

    def close(self, timeout_s: float | None = None) -> None:
        """Waits for outstanding batches (at most `timeout_s`), leaves, frees the group."""
        if self._connection.state is State.CLOSED:
            return
        deadline = time.monotonic() + (self.transfer_timeout_s if timeout_s is None else timeout_s)
        with self._link.cond:
            while self._link.undelivered and self._connection.error is None and time.monotonic() < deadline:
                self._link.cond.wait(0.05)
            if not self._connection.close():
                return
            session = self._connection.session  # a reconnect that finishes now gives its new session up itself
            self._link.cond.notify_all()
        session.finish()  # the stream ends: the teacher ends its answers too
        session.join(timeout_s=5)
        self._link.channel.leave(session.joined, timeout_s=min(self.rpc_timeout_s, 5.0))
        session.stop()
        self._link.pool.close()  # every replica's channel: cancels a heartbeat in flight
        # Threads end here, not during interpreter shutdown: a daemon thread that drops the
        # last reference to a process group then runs its destructor without a GIL to take
        # back, and the process aborts ("terminate called without an active exception").
        self._heartbeat_thread.join(timeout=5)
        session.join(timeout_s=5)
        self._link.fail_undelivered(TeacherError("the client was closed before this batch arrived"))

    def __enter__(self) -> "TeacherClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- futures -----------------------------------------------------------------

    def _acquire_slot(self, wait_s: float) -> None:
        """Takes one of max_inflight slots within `wait_s`; time spent reconnecting does not count
        (reconnect_timeout_s bounds it, and a failed reconnect frees every slot)."""
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            if self._slots.acquire(timeout=min(0.25, max(0.0, deadline - now))):
                return
            self._check_usable()
            if self._connection.reconnecting:
                deadline += time.monotonic() - now
            elif time.monotonic() >= deadline:
                raise TeacherUnavailable(f"no batch finished within {wait_s:.0f}s while {self.max_inflight} were "
                                         "in flight: the teacher is overloaded or stuck", grpc.StatusCode.UNAVAILABLE)

    def _check_usable(self) -> None:
        error = self._connection.unusable()
        if error is not None:
            raise error

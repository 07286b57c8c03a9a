"""The gRPC control plane: validate, hand to the engine, answer.

Handlers never touch torch.distributed or the model. Every request arrives as raw
bytes and is parsed here, so a malformed message becomes INVALID_ARGUMENT like any
other bad input; typed errors raised below become their status code in one place
(`_handler`). A Join is checked, and a cross-tokenizer session's batches re-tokenized,
in teacher_server/joining.py.

A session id names a session; it does not let anyone act on it: ids are shown in status
and metrics. Every call about a session must carry the secret its Join returned
(`session_for`), so only the process that joined can submit to it, renew it or end it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import math
import secrets
import time
from collections import deque

import grpc
import torch
from google.protobuf import message as pb_message
from google.protobuf import message_factory

from distill_common import rendezvous, tracing, wire
from distill_common.channel import SESSION_SECRET_KEY
from distill_common.outputs import BatchDataError, TeacherFacts, TopK
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.rendezvous import RendezvousError
from distill_common.wire import WireError
from teacher_server.config import ServerConfig
from teacher_server.edge import Caller, Callers
from teacher_server.engine import Engine
from teacher_server.errors import (FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
                                   ServiceError, bounded_message)
from teacher_server.joining import Joining
from teacher_server.metrics import Metrics
from teacher_server.sessions import Batch, Session

log = logging.getLogger(__name__)

SERVICE_NAME = "teacher.v1.TeacherService"
# The answers one SubmitStream holds for a client that does not read them, before it stops reading
# that client's requests (a student reads its answers as they come: tens at most wait).
STREAM_UNSENT_ANSWERS = 256
# Compared against when no session has the id, so an unknown id costs the same compare.
_NO_SESSION_SECRET = secrets.token_urlsafe(32)


class TeacherService:
    def __init__(self, engine: Engine, config: ServerConfig, metrics: Metrics, data_plane_host: str,
                 callers: Callers | None = None):
        self.engine = engine
        self.config = config
        self.callers = callers if callers is not None else Callers(config)  # who each token is (edge.py)
        self.metrics = metrics
        self.data_plane_host = data_plane_host
        self.info = engine.runner.info
        # What a session's outputs are checked against.
        self.facts = dataclasses.replace(TeacherFacts.from_info(self.teacher_info()), max_topk=config.max_topk)
        self.joining = Joining(engine.runner, config, self.facts)  # a Join's checks (joining.py)

    # ---- RPCs ---------------------------------------------------------------------

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.TeacherInfo:
        return self.teacher_info()

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        caller = self.callers.of(context)
        # Cheap refusals first (sizes, counts, limits, the session caps), then the vocabulary's
        # match, charged to the job (joining.py); admit checks the caps again.
        join = self.joining.checked(request, caller)
        self.engine.check_room(join.job_id, join.weight, max_job_sessions=caller.max_sessions,
                               job_limit=caller.limit("max_sessions"))
        session = await self.joining.session(join)
        outputs, alignment, backend = session.outputs, session.alignment, session.backend
        self.engine.admit(session, max_job_sessions=caller.max_sessions, job_limit=caller.limit("max_sessions"))
        log.info("session %s joined: job %s rank %d, %s, outputs %s", session.session_id, session.job_id,
                 session.job_rank, backend, outputs, extra={"session_id": session.session_id, "job_id": session.job_id})
        return pb.JoinResponse(
            session_id=session.session_id, info=self.teacher_info(), data_plane_host=self.data_plane_host,
            backend=backend,
            timeout_s=self.config.transfer_timeout_s,
            heartbeat_interval_s=self.config.heartbeat_interval_s, lease_s=self.config.lease_s,
            max_inflight=session.max_inflight, output_dtype=wire.dtype_name(outputs.dtype),
            stream_refusals_only=session.stream_refusals_only, session_secret=session.secret,
            alignment=None if alignment is None else pb.VocabularyAlignment(
                matched_student_ids=wire.encode(torch.from_numpy(alignment.match.student_ids).to(torch.int32)),
                student_vocab_size=len(alignment.vocabulary)))

    def session_for(self, context, session_id: str) -> Session:
        """The session a call is about, when the call may act on it; the one check every
        per-session RPC makes.

        The call must carry the session's secret (JoinResponse.session_secret) in the metadata
        key SESSION_SECRET_KEY, compared in constant time, and come from the operator's token
        or the session's job's token. None: PERMISSION_DENIED, whatever the id (so it says
        nothing about which sessions exist). A wrong secret, another job's token, or an
        unknown or ended session are one and the same NOT_FOUND: a caller cannot tell a live
        session it may not touch from one that does not exist, and an honest client, which
        always has the right secret, rejoins on NOT_FOUND as it does after a restart.
        """
        return self._checked_session(session_id, self._credentials(context))

    def _credentials(self, context) -> tuple[Caller, bytes]:
        secret = next((value for key, value in context.invocation_metadata() or () if key == SESSION_SECRET_KEY), "")
        if not secret:
            raise PermissionDenied(f"this call is about a session but carries no session secret (the gRPC metadata "
                                   f"key {SESSION_SECRET_KEY!r}, from JoinResponse.session_secret): a client older "
                                   "than the teacher sends none; update it")
        return self.callers.of(context), secret.encode()

    def _checked_session(self, session_id: str, credentials: tuple[Caller, bytes]) -> Session:
        caller, secret = credentials
        try:
            session = self.engine.session(session_id)
        except NotFound:
            session = None
        matches = hmac.compare_digest(secret, (session.secret if session is not None else _NO_SESSION_SECRET).encode())
        if session is None or not matches or caller.job_id not in (None, session.job_id):
            ended = self.engine.ended(session_id) if session is None else None
            if (ended is not None and hmac.compare_digest(secret, ended[0].encode())
                    and caller.job_id in (None, ended[1])):  # its own student learns why, e.g. a failed batch
                raise NotFound(f"session {session_id[:64]!r} has ended ({ended[2]}); join again")
            raise NotFound(f"session {session_id[:64]!r} is unknown or has ended, or this call lacks its secret: "
                           "join again")
        return session

    async def Submit(self, request: pb.SubmitRequest, context) -> pb.SubmitResponse:
        return (await self._submit(request, self.session_for(context, request.session_id)))[1]

    async def _submit(self, request: pb.SubmitRequest, session: Session) -> tuple[Session, pb.SubmitResponse]:
        if request.batch_id != session.next_batch_id:
            raise InvalidArgument(f"batch_id {request.batch_id} is out of order: the session expects "
                                  f"{session.next_batch_id} (batch ids count 0, 1, 2, ... per session)")
        # Used up whatever follows: a client that streams its batches has sent the next
        # ones already, numbered on the assumption that this one took its id.
        session.next_batch_id += 1
        # Queued batches are what a session can pile up here; batches already computed
        # and being sent are bounded by the scheduler, which plans no more than
        # max_inflight of a session. (Counting sends too would race the student, which
        # sees its receive finish a moment before the teacher sees its send finish.)
        # Batches being re-tokenized count as queued: a batch refused once re-tokenized has held its slot meanwhile.
        queued = self.engine.queued(session) + session.retokenizing
        if queued >= session.max_inflight:
            raise ResourceExhausted(f"session already has {queued} batches queued (its "
                                    f"max_inflight, at most the teacher's --max-inflight {self.config.max_inflight}); "
                                    "receive outputs before submitting more")
        alignment = session.alignment
        batch = self._decode_batch(request, len(alignment.vocabulary) if alignment is not None else 0)
        try:
            batch.data = session.outputs.read_batch(request, batch.rows, batch.seq_len)
        except BatchDataError as e:
            raise InvalidArgument(str(e)) from e
        # What its outputs take in teacher memory until the student has them (the scheduler's budget):
        # shaped to the ids the student sent, whatever the teacher's tokens are.
        output_bytes = sum(math.prod(spec.shape) * spec.dtype.itemsize
                           for spec in session.outputs.layout(batch.rows, batch.seq_len))
        if alignment is None:
            batch.output_bytes = output_bytes
            inflight = self.engine.submit(session, batch)
        else:
            # Re-tokenizing takes ~5 ms per 1,000 tokens: in a thread, charged to the session's job (joining.py),
            # so that one job's batches do not hold up every other call. The session's lock keeps its batches in
            # submit order: the id was taken above, before the first await, and the lock hands itself on first
            # come, first served.
            session.retokenizing += 1
            try:
                async with session.submit_order:
                    batch = await self.joining.retokenized(batch, session)
                    batch.output_bytes = output_bytes
                    inflight = self.engine.submit(session, batch)
            finally:
                session.retokenizing -= 1
        return session, pb.SubmitResponse(batch_id=request.batch_id, inflight=inflight)

    async def SubmitStream(self, requests, context):
        """Answers each streamed batch in order (or only the refused ones: JoinRequest.stream_refusals_only),
        a refusal being an answer, not the end; and carries the session's events (announced, failed:
        distill_common/announcements.py), taken from its outbox whenever the stream is free.

        The stream's requests are read by a task of their own, so events go out while no
        request comes. The stream's metadata carries the session's secret (session_for), read once. The stream ends once the student ended its requests and what is
        pending went out. With STREAM_UNSENT_ANSWERS answers waiting for a client that does not read
        them, the reading waits too (its flow control then stops the client's sends), so a stream
        holds a bounded number of answers, refusals included.
        """
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        answers: deque[pb.SubmitResponse] = deque()
        room = asyncio.Event()  # set while fewer than STREAM_UNSENT_ANSWERS answers wait
        room.set()
        outbox = None  # the events of the session this stream submits to
        credentials = None
        requests_ended = False

        def wake_up() -> None:  # from any thread: the announcer, the engine
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed: the server is gone, and the stream with it
                pass

        async def read() -> None:
            nonlocal outbox, requests_ended, credentials
            try:
                async for raw in requests:
                    batch_id = 0
                    try:
                        request = _parse(pb.SubmitRequest, raw)
                        batch_id = request.batch_id
                        tracing.mark("t_recv", batch_id)
                        if credentials is None:
                            credentials = self._credentials(context)
                        session = self._checked_session(request.session_id, credentials)
                        if outbox is None:
                            if not session.outbox.attach(wake_up):
                                raise FailedPrecondition(
                                    f"another stream submits to session {session.session_id} and receives its events: "
                                    "submit on that one (one stream per session)")
                            outbox = session.outbox
                        elif session.outbox is not outbox:
                            raise FailedPrecondition("this stream submits to another session: open one stream per "
                                                     "session")
                        session, response = await self._submit(request, session)
                        if not session.stream_refusals_only:
                            answers.append(response)
                            wake.set()
                    except ServiceError as e:
                        self.metrics.rpc_errors.labels("SubmitStream", e.code.name).inc()
                        answers.append(pb.SubmitResponse(batch_id=batch_id, error_code=e.code.value[0],
                                                         error_message=str(e)))
                        wake.set()
                    if len(answers) >= STREAM_UNSENT_ANSWERS:
                        room.clear()
                        await room.wait()
            finally:
                requests_ended = True
                wake.set()

        reader = asyncio.create_task(read())
        try:
            while True:
                await wake.wait()
                wake.clear()
                ended = requests_ended  # read before taking: what came before it is taken now
                while answers:
                    yield answers.popleft()
                    if len(answers) < STREAM_UNSENT_ANSWERS:
                        room.set()
                events = outbox.take() if outbox is not None else None
                if events is not None:
                    yield events
                if ended:
                    await reader  # raises what ended the reading, if anything did
                    return
        finally:
            reader.cancel()
            if outbox is not None:
                outbox.detach(wake_up)

    async def Rendezvous(self, request: pb.RendezvousRequest, context) -> pb.RendezvousResponse:
        session = self.session_for(context, request.session_id)
        try:
            return await session.rendezvous.serve(request)
        except RendezvousError as e:
            error = {"quota": ResourceExhausted, "invalid": InvalidArgument, "ended": NotFound}.get(e.kind,
                                                                                                  PermissionDenied)
            raise error(str(e)) from e

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        session = self.session_for(context, request.session_id)
        self.engine.heartbeat(session)
        return pb.HeartbeatResponse(batches_sent=session.batches_sent, inflight=session.inflight)

    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        session = self.session_for(context, request.session_id)
        self.engine.leave(session, drain=request.drain)
        return pb.LeaveResponse(batches_sent=session.batches_sent)

    async def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.StatusResponse:
        """Every session for the operator; a job token's holder sees its job's only."""
        caller = self.callers.of(context)
        now = time.monotonic()
        sessions = [pb.SessionStatus(
            session_id=s.session_id, job_id=s.job_id, job_rank=s.job_rank, backend=s.backend, state=s.state,
            batches_submitted=s.batches_submitted, batches_sent=s.batches_sent, tokens_served=s.tokens_served,
            bytes_sent=s.bytes_sent, inflight=s.inflight, last_heartbeat_age_s=now - s.last_heartbeat,
            weight=s.weight) for s in self.engine.sessions() if caller.job_id in (None, s.job_id)]
        return pb.StatusResponse(info=self.teacher_info(), sessions=sessions,
                                 busy_fraction=self.metrics.busy_clock.fraction(),
                                 queue_depth=self.engine.queue_depth(), sessions_total=len(self.engine.sessions()),
                                 held_bytes=self.engine.held_bytes(),
                                 held_bytes_limit=self.engine.scheduler.held_bytes_limit,
                                 weight_total=self.engine.weight_total())

    # ---- validation ---------------------------------------------------------------

    def teacher_info(self) -> pb.TeacherInfo:
        i, c = self.info, self.config
        return pb.TeacherInfo(
            model_name=i.model_name, architecture=i.architecture, vocab_size=i.vocab_size, hidden_size=i.hidden_size,
            num_layers=i.num_layers, dtype=wire.dtype_name(i.dtype), device_type=i.device.type, tp_size=i.tp_size,
            max_batch_tokens=c.max_batch_tokens, max_seq_len=c.max_seq_len, max_sessions=c.max_sessions,
            max_inflight=c.max_inflight, tokenizer_fingerprint=i.tokenizer_fingerprint,
            torch_version=i.torch_version, nccl_version=i.nccl_version, head=i.head.to_info(),
            attention=i.attention.to_info(), max_score_ids=c.max_score_ids, quantization=i.quantization.to_info(),
            topk_form=TopK.form, weights_fingerprint=i.weights_fingerprint)

    def _decode_batch(self, request: pb.SubmitRequest, student_vocab_size: int = 0) -> Batch:
        """The batch's ids and mask, checked; ids lie in the teacher's vocabulary, or in the student's
        (`student_vocab_size`) for a cross-tokenizer session."""
        limits = self.config
        shape = list(request.input_ids.shape)
        if len(shape) != 2:
            raise InvalidArgument(f"input_ids must be 2-D [batch, seq], got shape {shape}")
        if any(dim <= 0 for dim in shape):
            raise InvalidArgument(f"input_ids of shape {shape} is empty: send at least one token in one row")
        if shape[1] > limits.max_seq_len:
            model = limits.position_limit
            why = f" (the model's limit: {model})" if model and model.positions == limits.max_seq_len else ""
            raise InvalidArgument(f"sequence length {shape[1]} exceeds the teacher's --max-seq-len "
                                  f"{limits.max_seq_len}{why}: truncate or split sequences")
        if shape[0] * shape[1] > limits.max_batch_tokens:
            raise ResourceExhausted(f"batch of {shape[0]} x {shape[1]} = {shape[0] * shape[1]} tokens exceeds the "
                                    f"teacher's --max-batch-tokens {limits.max_batch_tokens}: send smaller batches")
        try:
            ids = wire.decode_ids(request.input_ids, what="input_ids", dtypes=wire.ID_DTYPES,
                                  max_elements=limits.max_batch_tokens)
            mask = None
            if request.HasField("attention_mask"):
                mask = wire.decode_ids(request.attention_mask, what="attention_mask", dtypes=wire.MASK_DTYPES,
                                       max_elements=limits.max_batch_tokens)
        except WireError as e:
            raise InvalidArgument(str(e)) from e
        low, high = int(ids.min()), int(ids.max())
        if student_vocab_size and (low < 0 or high >= student_vocab_size):
            raise InvalidArgument(f"token ids must lie in [0, {student_vocab_size}) (the student vocabulary sent at "
                                  f"join), got values in [{low}, {high}]")
        if not student_vocab_size and (low < 0 or high >= self.info.vocab_size):
            raise InvalidArgument(f"token ids must lie in [0, {self.info.vocab_size}) (the teacher's vocabulary), "
                                  f"got values in [{low}, {high}]: is the student using the teacher's tokenizer?")
        if mask is None:
            ids = torch.from_numpy(ids)
            return Batch(batch_id=request.batch_id, input_ids=ids, attention_mask=torch.ones_like(ids))
        if mask.shape != ids.shape:
            raise InvalidArgument(f"attention_mask shape {list(mask.shape)} differs from input_ids shape {shape}")
        if mask.min() < 0 or mask.max() > 1:
            raise InvalidArgument("attention_mask must hold only 0 and 1")
        if not mask.any(axis=1).all():
            raise InvalidArgument("every row of attention_mask needs at least one 1 (a row of padding only)")
        ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
        return Batch(batch_id=request.batch_id, input_ids=ids, attention_mask=mask)


# Calls whose requests are small by nature, refused past this before they are parsed: the
# teacher's --max-request-bytes is sized for a batch or a Join, and parsing a request that size
# into thousands of fields costs the event loop what the call is not worth.
_REQUEST_LIMIT_BYTES = {"Rendezvous": rendezvous.MAX_REQUEST_BYTES}
_REQUEST_LIMIT_WHY = {"Rendezvous": f"{rendezvous.MAX_KEYS_PER_CALL} keys, and a value and an expected value of "
                                    f"at most the {rendezvous.MAX_BYTES} bytes a session's rendezvous holds"}


def _parse(request_class, raw: bytes):
    try:
        return request_class.FromString(raw)
    except pb_message.DecodeError as e:
        raise InvalidArgument(f"malformed {request_class.DESCRIPTOR.name}: {e}") from e


def _handler(service: TeacherService, name: str, request_class, metrics: Metrics):
    """Parses the raw request and maps typed errors to status codes: the one place for both."""
    method = getattr(service, name)

    limit_bytes = _REQUEST_LIMIT_BYTES.get(name)

    async def handle(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            if limit_bytes is not None and len(raw) > limit_bytes:
                raise InvalidArgument(f"a {name} request of {len(raw)} bytes is larger than any this call needs "
                                      f"({limit_bytes} bytes at most: {_REQUEST_LIMIT_WHY[name]}): refused unread")
            return await method(_parse(request_class, raw), context)
        except ServiceError as e:
            metrics.rpc_errors.labels(name, e.code.name).inc()
            code, message = e.code, str(e)
        except Exception as e:
            log.exception("%s failed", name)
            metrics.rpc_errors.labels(name, "INTERNAL").inc()
            code, message = grpc.StatusCode.INTERNAL, bounded_message(f"{name} failed inside the teacher: {e}")
        # Aborted outside the except clause, with the request dropped: grpc keeps the abort's exception a
        # while, and through its traceback (and the refusal it would chain) every frame's locals (a request
        # of up to --max-request-bytes, a vocabulary) would live as long.
        del raw
        await context.abort(code, message)

    return handle


def generic_handler(service: TeacherService, metrics: Metrics) -> grpc.GenericRpcHandler:
    descriptor = pb.DESCRIPTOR.services_by_name["TeacherService"]
    handlers = {}
    for method in descriptor.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        if method.client_streaming:  # SubmitStream answers errors in-band, message by message
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                getattr(service, method.name), request_deserializer=None,
                response_serializer=response_class.SerializeToString)
            continue
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _handler(service, method.name, request_class, metrics),
            request_deserializer=None,  # raw bytes: parsed in _handler so bad bytes get INVALID_ARGUMENT
            response_serializer=response_class.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

"""The gRPC control plane: validate, hand to the engine, answer.

Handlers never touch torch.distributed or the model. Every request arrives as raw
bytes and is parsed here, so a malformed message becomes INVALID_ARGUMENT like any
other bad input; typed errors raised below become their status code in one place
(`_handler`).
"""

from __future__ import annotations

import logging
import time

import grpc
import torch
from google.protobuf import message as pb_message
from google.protobuf import message_factory

from distill_common import tracing, wire
from distill_common.outputs import BatchDataError, OutputRequest, OutputSpecError, TeacherFacts, VocabularyMismatch
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.session_group import device_uuid
from distill_common.wire import WireError
from teacher_server.config import ServerConfig
from teacher_server.engine import Engine
from teacher_server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, ServiceError
from teacher_server.metrics import Metrics
from teacher_server.sessions import Batch, Session

log = logging.getLogger(__name__)

SERVICE_NAME = "teacher.v1.TeacherService"


class TeacherService:
    def __init__(self, engine: Engine, config: ServerConfig, metrics: Metrics, store_host: str, store_port: int):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.store_host = store_host
        self.store_port = store_port
        self.info = engine.runner.info
        self.teacher_uuid = device_uuid(self.info.device)
        self.facts = TeacherFacts.from_info(self.teacher_info())  # what a session's outputs are checked against

    # ---- RPCs ---------------------------------------------------------------------

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.TeacherInfo:
        return self.teacher_info()

    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        try:
            outputs = OutputRequest.resolve(request.outputs, self.facts)
        except OutputSpecError as e:
            raise InvalidArgument(str(e)) from e
        backend = self._check_peer(request.peer)
        try:
            outputs.check_student(request.vocab_size, request.tokenizer_fingerprint)
        except VocabularyMismatch as e:
            raise FailedPrecondition(str(e)) from e
        max_inflight = request.max_inflight or self.config.max_inflight
        if max_inflight < 0 or max_inflight > self.config.max_inflight:
            raise InvalidArgument(f"max_inflight {request.max_inflight} is outside 1..{self.config.max_inflight} "
                                  "(the teacher's --max-inflight)")
        weight = request.weight or 1.0
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise InvalidArgument(f"weight {request.weight} must be a positive finite number")
        if weight > self.config.max_weight:
            raise InvalidArgument(f"weight {weight} exceeds the teacher's --max-weight {self.config.max_weight}: "
                                  "ask for less, or start the teacher with a larger --max-weight")
        session = Session(job_id=request.job_id[:128] or "unnamed", job_rank=request.job_rank, outputs=outputs,
                          backend=backend, peer_device_type=request.peer.device_type, max_inflight=max_inflight,
                          weight=weight, stream_refusals_only=request.stream_refusals_only)
        self.engine.admit(session)
        log.info("session %s joined: job %s rank %d, %s, outputs %s", session.session_id, session.job_id,
                 session.job_rank, backend, outputs, extra={"session_id": session.session_id, "job_id": session.job_id})
        return pb.JoinResponse(
            session_id=session.session_id, info=self.teacher_info(), store_host=self.store_host,
            store_port=self.store_port, store_prefix=session.store_prefix, backend=backend,
            timeout_s=self.config.transfer_timeout_s,
            heartbeat_interval_s=self.config.heartbeat_interval_s, lease_s=self.config.lease_s,
            max_inflight=max_inflight, output_dtype=wire.dtype_name(outputs.dtype),
            stream_refusals_only=session.stream_refusals_only)

    async def Submit(self, request: pb.SubmitRequest, context) -> pb.SubmitResponse:
        return self._submit(request)[1]

    def _submit(self, request: pb.SubmitRequest) -> tuple[Session, pb.SubmitResponse]:
        session = self.engine.session(request.session_id)
        if request.batch_id != session.next_batch_id:
            raise InvalidArgument(f"batch_id {request.batch_id} is out of order: the session expects "
                                  f"{session.next_batch_id} (batch ids count 0, 1, 2, ... per session)")
        # Used up whatever follows: a client that streams its batches has sent the next
        # ones already, numbered on the assumption that this one took its id.
        session.next_batch_id += 1
        try:
            # Queued batches are what a session can pile up here; batches already computed
            # and being sent are bounded by the scheduler, which plans no more than
            # max_inflight of a session. (Counting sends too would race the student, which
            # sees its receive finish a moment before the teacher sees its send finish.)
            queued = self.engine.queued(session)
            if queued >= session.max_inflight:
                raise ResourceExhausted(f"session already has {queued} batches queued (its "
                                        f"max_inflight, at most the teacher's --max-inflight {self.config.max_inflight}); "
                                        "receive outputs before submitting more")
            batch = self._decode_batch(request)
            try:
                batch.data = session.outputs.read_batch(request, batch.rows, batch.seq_len)
            except BatchDataError as e:
                raise InvalidArgument(str(e)) from e
            inflight = self.engine.submit(session, batch)
        except ServiceError:
            self.engine.refuse(session, request.batch_id)  # a student waiting for its announcement wakes
            raise
        return session, pb.SubmitResponse(batch_id=request.batch_id, inflight=inflight)

    async def SubmitStream(self, requests, context):
        """Answers each streamed batch in order (or only the refused ones: JoinRequest.stream_refusals_only);
        a refusal is an answer, not the end."""
        async for raw in requests:
            batch_id = 0
            try:
                request = _parse(pb.SubmitRequest, raw)
                batch_id = request.batch_id
                tracing.mark("t_recv", batch_id)
                session, response = self._submit(request)
                if not session.stream_refusals_only:
                    yield response
            except ServiceError as e:
                self.metrics.rpc_errors.labels("SubmitStream", e.code.name).inc()
                yield pb.SubmitResponse(batch_id=batch_id, error_code=e.code.value[0], error_message=str(e))

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        session = self.engine.session(request.session_id)
        self.engine.heartbeat(session)
        return pb.HeartbeatResponse(batches_sent=session.batches_sent, inflight=session.inflight)

    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        session = self.engine.session(request.session_id)
        self.engine.leave(session, drain=request.drain)
        return pb.LeaveResponse(batches_sent=session.batches_sent)

    async def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.StatusResponse:
        now = time.monotonic()
        sessions = [pb.SessionStatus(
            session_id=s.session_id, job_id=s.job_id, job_rank=s.job_rank, backend=s.backend, state=s.state,
            batches_submitted=s.batches_submitted, batches_sent=s.batches_sent, tokens_served=s.tokens_served,
            bytes_sent=s.bytes_sent, inflight=s.inflight, last_heartbeat_age_s=now - s.last_heartbeat,
            weight=s.weight) for s in self.engine.sessions()]
        return pb.StatusResponse(info=self.teacher_info(), sessions=sessions,
                                 busy_fraction=self.metrics.busy_clock.fraction(),
                                 queue_depth=self.engine.queue_depth())

    # ---- validation ---------------------------------------------------------------

    def teacher_info(self) -> pb.TeacherInfo:
        i, c = self.info, self.config
        return pb.TeacherInfo(
            model_name=i.model_name, architecture=i.architecture, vocab_size=i.vocab_size, hidden_size=i.hidden_size,
            num_layers=i.num_layers, dtype=wire.dtype_name(i.dtype), device_type=i.device.type, tp_size=i.tp_size,
            max_batch_tokens=c.max_batch_tokens, max_seq_len=c.max_seq_len, max_sessions=c.max_sessions,
            max_inflight=c.max_inflight, tokenizer_fingerprint=i.tokenizer_fingerprint,
            torch_version=i.torch_version, nccl_version=i.nccl_version, max_score_ids=c.max_score_ids)

    def _check_peer(self, peer: pb.PeerInfo) -> str:
        if peer.device_type not in ("cpu", "cuda"):
            raise InvalidArgument(f"peer.device_type {peer.device_type!r} must be 'cpu' or 'cuda'")
        teacher_major = torch.__version__.split(".")[0]
        if peer.torch_version.split(".")[0] != teacher_major:
            raise FailedPrecondition(f"student torch {peer.torch_version or '(unknown)'} cannot talk to the teacher's "
                                     f"torch {torch.__version__}: use torch {teacher_major}.x on the student")
        if not (peer.device_type == "cuda" and self.info.device.type == "cuda"):
            return "gloo"
        if peer.device_uuid and peer.device_uuid == self.teacher_uuid:
            raise FailedPrecondition(
                f"the student's GPU ({peer.device_uuid}) is the one the teacher uses: NCCL cannot put two ranks of "
                "one communicator on one GPU. Run the student on another GPU (CUDA_VISIBLE_DEVICES)")
        if peer.nccl_version.split(".")[:2] != self.info.nccl_version.split(".")[:2]:
            raise FailedPrecondition(
                f"the student's NCCL {peer.nccl_version or '(none)'} differs from the teacher's "
                f"{self.info.nccl_version}: install the same torch/NCCL build on both sides")
        return "nccl"

    def _decode_batch(self, request: pb.SubmitRequest) -> Batch:
        limits = self.config
        shape = list(request.input_ids.shape)
        if len(shape) != 2:
            raise InvalidArgument(f"input_ids must be 2-D [batch, seq], got shape {shape}")
        if any(dim <= 0 for dim in shape):
            raise InvalidArgument(f"input_ids of shape {shape} is empty: send at least one token in one row")
        if shape[1] > limits.max_seq_len:
            raise InvalidArgument(f"sequence length {shape[1]} exceeds the teacher's --max-seq-len "
                                  f"{limits.max_seq_len}: truncate or split sequences")
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
        if low < 0 or high >= self.info.vocab_size:
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


def _parse(request_class, raw: bytes):
    try:
        return request_class.FromString(raw)
    except pb_message.DecodeError as e:
        raise InvalidArgument(f"malformed {request_class.DESCRIPTOR.name}: {e}") from e


def _handler(service: TeacherService, name: str, request_class, metrics: Metrics):
    """Parses the raw request and maps typed errors to status codes: the one place for both."""
    method = getattr(service, name)

    async def handle(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            return await method(_parse(request_class, raw), context)
        except ServiceError as e:
            metrics.rpc_errors.labels(name, e.code.name).inc()
            await context.abort(e.code, str(e))
        except Exception as e:
            log.exception("%s failed", name)
            metrics.rpc_errors.labels(name, "INTERNAL").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"{name} failed inside the teacher: {e}")

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

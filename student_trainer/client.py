"""TeacherClient: how a training process gets the teacher's outputs.

    with TeacherClient("host:50051", device="cuda:1", logits=True, topk=0) as teacher:
        fut = teacher.submit(input_ids, attention_mask)   # returns at once
        out = fut.result(timeout=60)                       # TeacherOutput

Join tells the client every shape it will receive, so right after a batch is
registered the client allocates its output buffers and posts the receives; the
teacher's sends land in them in submit order. A completion thread waits for each
batch's receives (with a deadline) and resolves its future. At most `max_inflight`
batches are outstanding: `submit` blocks beyond that (backpressure, not memory).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch

from distill_common import wire
from distill_common.channel import TeacherUnreachable, channel_credentials, open_channel, wait_until_reachable
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from distill_common.session_group import (STUDENT_RANK, SessionGroup, TransferError, build_group, connect_store,
                                          device_uuid, handshake, local_address_towards, nccl_version,
                                          prefix_token)
from distill_common.vocab import tokenizer_fingerprint
from student_trainer.errors import TeacherError, TeacherUnavailable, TransferFailed, from_rpc_error, from_status

log = logging.getLogger(__name__)


@dataclass
class TeacherInfo:
    model_name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: str
    tokenizer_fingerprint: str
    max_batch_tokens: int
    max_seq_len: int

    @classmethod
    def from_proto(cls, info: pb.TeacherInfo) -> "TeacherInfo":
        return cls(model_name=info.model_name, architecture=info.architecture, vocab_size=info.vocab_size,
                   hidden_size=info.hidden_size, num_layers=info.num_layers, dtype=info.dtype,
                   tokenizer_fingerprint=info.tokenizer_fingerprint, max_batch_tokens=info.max_batch_tokens,
                   max_seq_len=info.max_seq_len)


@dataclass
class TeacherOutput:
    """One batch's outputs, on the client's device. Absent kinds are None / empty."""

    batch_id: int
    logits: torch.Tensor | None = None  # [B, S, V]
    topk_values: torch.Tensor | None = None  # [B, S, k]
    topk_indices: torch.Tensor | None = None  # [B, S, k] int32
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, S, H]


@dataclass
class _Pending:
    batch_id: int
    shape: tuple[int, int]
    buffers: list[torch.Tensor]
    works: list
    future: Future


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def _grpc_options() -> list:
    return [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class TeacherClient:
    def __init__(self, address: str, device: str | torch.device = "cpu", *, logits: bool = True, topk: int = 0,
                 hidden_layers=(), dtype: str | None = None, max_inflight: int = 0, job_id: str | None = None,
                 job_rank: int | None = None, tokenizer=None, vocab_size: int = 0, weight: float = 1.0,
                 rpc_timeout_s: float = 30.0, auth_token: str | None = None,
                 join_timeout_s: float = 120.0, transfer_timeout_s: float | None = None,
                 tls_ca: str | bool | None = None, tls_cert: str | None = None, tls_key: str | None = None):
        """`tls_ca`: talk TLS to a teacher started with --tls-cert, trusting this PEM CA bundle
        (True: the system's roots). `tls_cert`/`tls_key`: this client's certificate, for a
        teacher started with --tls-client-ca. The data plane is not encrypted either way."""
        self.address = address
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rpc_timeout_s = rpc_timeout_s
        self._tls = bool(tls_ca)
        self._channel = open_channel(address, channel_credentials(tls_ca, tls_cert, tls_key), _grpc_options())
        token = os.environ.get("TEACHER_AUTH_TOKEN", "") if auth_token is None else auth_token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._stub = pb_grpc.TeacherServiceStub(self._channel)
        self._closed = False
        self._broken: TeacherError | None = None
        self._pending: deque[_Pending] = deque()
        self._requests: queue.Queue = queue.Queue()
        self._awaiting_ack: deque[_Pending] = deque()
        self._submit_lock = threading.Lock()
        self._to_receive: queue.Queue = queue.Queue()
        self._recv_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._unresolved = 0  # futures handed out and not yet resolved
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._group: SessionGroup | None = None
        self.session_id = ""

        fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""
        request = pb.JoinRequest(
            job_id=job_id or os.environ.get("TORCHELASTIC_RUN_ID", "") or f"pid{os.getpid()}",
            job_rank=int(os.environ.get("RANK", "0")) if job_rank is None else job_rank,
            outputs=pb.OutputSpec(logits=logits, topk=topk, hidden_layers=list(hidden_layers), dtype=dtype or ""),
            peer=pb.PeerInfo(device_type=self.device.type, device_uuid=device_uuid(self.device),
                             torch_version=torch.__version__,
                             nccl_version=nccl_version() if self.device.type == "cuda" else ""),
            max_inflight=max_inflight, tokenizer_fingerprint=fingerprint,
            # The width of the student's logits (its output embedding's rows), which may
            # exceed len(tokenizer): models pad it. Without it, no size check is made.
            vocab_size=vocab_size, weight=weight)
        self._wait_for_server(join_timeout_s)
        joined = self._call("Join", request)
        self.session_id = joined.session_id
        self.info = TeacherInfo.from_proto(joined.info)
        self.backend = joined.backend
        self.max_inflight = joined.max_inflight
        self.output_dtype = wire.parse_output_dtype(joined.output_dtype)
        self.topk = topk
        self.logits = logits
        self.hidden_layers = tuple(hidden_layers)
        self.transfer_timeout_s = transfer_timeout_s or joined.timeout_s
        self.heartbeat_interval_s = joined.heartbeat_interval_s
        self._slots = threading.Semaphore(self.max_inflight)
        try:
            self._connect(joined, join_timeout_s)
        except BaseException:
            self._leave(drain=False)
            self._channel.close()
            raise
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="teacher-heartbeat", daemon=True)
        self._heartbeat_thread.start()
        self._completion_thread = threading.Thread(target=self._completion_loop, name="teacher-recv", daemon=True)
        self._completion_thread.start()
        # One stream carries every Submit of the session: no round trip per batch.
        self._responses = self._stub.SubmitStream(self._request_stream(), metadata=self._metadata)
        self._ack_thread = threading.Thread(target=self._ack_loop, name="teacher-acks", daemon=True)
        self._ack_thread.start()
        self._receive_thread = threading.Thread(target=self._receive_loop, name="teacher-post-recv", daemon=True)
        self._receive_thread.start()
        log.info("joined teacher %s as session %s (%s, %s)", address, self.session_id, self.backend,
                 self.info.model_name)

    # ---- public ------------------------------------------------------------------

    def submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               timeout_s: float | None = None) -> Future:
        """Registers a [B, S] batch; returns at once a Future of its TeacherOutput.

        The Submit RPC and the posting of the receives happen on a submitter thread,
        in order, so a training loop never waits on the control plane. A refusal by
        the teacher (bad ids, a limit) is raised by the future's result(); malformed
        tensors are refused here. Blocks while max_inflight batches are outstanding,
        at most `timeout_s` (default: the transfer timeout).
        """
        self._check_usable()
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {list(attention_mask.shape)} differs from input_ids "
                             f"{list(input_ids.shape)}")
        # Encoded now: the caller may reuse its tensors as soon as submit returns.
        ids = wire.encode(input_ids)
        mask = wire.encode(attention_mask) if attention_mask is not None else None
        wait_s = self.transfer_timeout_s if timeout_s is None else timeout_s
        if not self._slots.acquire(timeout=wait_s):
            raise TeacherUnavailable(f"no batch finished within {wait_s:.0f}s while {self.max_inflight} were in "
                                     "flight: the teacher is overloaded or stuck")
        future: Future = Future()
        future.add_done_callback(lambda _: self._slots.release())
        with self._cond:
            self._unresolved += 1
        future.add_done_callback(self._resolved)
        with self._submit_lock:  # ids, the acknowledgement queue and the stream in one order
            self._check_usable()
            request = pb.SubmitRequest(session_id=self.session_id, batch_id=self._next_batch_id, input_ids=ids)
            if mask is not None:
                request.attention_mask.CopyFrom(mask)
            self._awaiting_ack.append(_Pending(self._next_batch_id, tuple(input_ids.shape), [], [], future))
            self._next_batch_id += 1  # used up, accepted or refused (see SubmitRequest.batch_id)
            self._requests.put(request)
        return future

    def _resolved(self, _future) -> None:
        with self._cond:
            self._unresolved -= 1
            self._cond.notify_all()

    def _request_stream(self):
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def _ack_loop(self) -> None:
        """Reads the teacher's answers to the streamed batches, in order."""
        try:
            for response in self._responses:
                with self._submit_lock:
                    pending = self._awaiting_ack.popleft()
                if response.error_code:
                    code = _STATUS_BY_NUMBER.get(response.error_code, grpc.StatusCode.UNKNOWN)
                    pending.future.set_exception(from_status(code, response.error_message,
                                                             f"Submit to teacher {self.address}"))
                else:
                    self._to_receive.put(pending)
        except grpc.RpcError as e:
            if not self._stop.is_set():
                self._break(from_rpc_error(e, f"the submit stream to teacher {self.address}"))
        with self._submit_lock:
            orphans, self._awaiting_ack = list(self._awaiting_ack), deque()
        for pending in orphans:
            if not pending.future.done():
                pending.future.set_exception(self._broken or TeacherError("the client was closed"))

    def _receive_loop(self) -> None:
        """Posts each batch's receives, in order, once the teacher announced its sends."""
        while True:
            pending = self._to_receive.get()
            if pending is None:
                return
            try:
                self._group.await_announced(pending.batch_id, self.transfer_timeout_s)
                self._post_receives(pending)
            except Exception as e:
                if not self._stop.is_set():
                    self._break(TransferFailed(f"receiving batch {pending.batch_id}: {e}"))
                pending.future.set_exception(self._broken or TeacherError("the client was closed"))
                continue
            with self._cond:
                self._pending.append(pending)
                self._cond.notify_all()

    def close(self, timeout_s: float | None = None) -> None:
        """Waits for outstanding batches (at most `timeout_s`), leaves, frees the group."""
        if self._closed:
            return
        deadline = time.monotonic() + (self.transfer_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while self._unresolved and self._broken is None and time.monotonic() < deadline:
                self._cond.wait(0.05)
        self._closed = True
        self._stop.set()
        self._requests.put(None)
        self._to_receive.put(None)
        with self._cond:
            self._cond.notify_all()
        self._ack_thread.join(timeout=5)
        self._receive_thread.join(timeout=5)
        self._completion_thread.join(timeout=5)
        self._leave(drain=False)
        if self._group is not None:
            self._group.abort()
        self._channel.close()
        self._fail_pending(TeacherError("the client was closed before this batch arrived"))

    def __enter__(self) -> "TeacherClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- joining -----------------------------------------------------------------

    def _wait_for_server(self, timeout_s: float) -> None:
        try:  # a TLS mismatch is reported at once, with the argument to change
            wait_until_reachable(self._channel, self.address, timeout_s, tls=self._tls)
        except TeacherUnreachable as e:
            self._channel.close()
            raise TeacherUnavailable(str(e)) from None

    def _connect(self, joined: pb.JoinResponse, timeout_s: float) -> None:
        store = connect_store(joined.store_host, joined.store_port, timeout_s)
        gloo_host = local_address_towards(joined.store_host, joined.store_port) if joined.backend == "gloo" else ""
        self._group = build_group(store, joined.store_prefix, backend=joined.backend, rank=STUDENT_RANK,
                                  device=self.device, timeout_s=timeout_s, gloo_host=gloo_host)
        handshake(self._group, prefix_token(joined.store_prefix), timeout_s)
        self._store = store  # keeps the connection the group uses alive
        self._next_batch_id = 0

    # ---- receiving ---------------------------------------------------------------

    def _post_receives(self, pending: _Pending) -> None:
        b, s = pending.shape
        specs = wire.output_layout(batch=b, seq=s, vocab=self.info.vocab_size, hidden=self.info.hidden_size,
                                   logits=self.logits, topk=self.topk, hidden_layers=self.hidden_layers,
                                   dtype=self.output_dtype)
        if self.backend == "gloo":  # gloo writes host memory; moved to the device on arrival
            pending.buffers = [torch.empty(size, dtype=dtype) for size, dtype in specs]
            pending.works = [self._group.recv(buffer) for buffer in pending.buffers]
            return
        # NCCL makes its stream wait for the current stream when a receive is posted. On
        # our own idle stream the receive starts at once instead of queueing behind the
        # training step's kernels; the buffers are allocated there too, so the allocator
        # never hands NCCL memory that queued kernels of another stream still read.
        with torch.cuda.device(self.device), torch.cuda.stream(self._recv_stream):
            pending.buffers = [torch.empty(size, dtype=dtype, device=self.device) for size, dtype in specs]
            pending.works = [self._group.recv(buffer) for buffer in pending.buffers]

    def _completion_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop.is_set():
                    self._cond.wait(0.1)
                if not self._pending:
                    return
                pending = self._pending[0]
            try:
                for work in pending.works:
                    self._group.wait(work, self.transfer_timeout_s, what=f"receiving batch {pending.batch_id}")
                result = self._assemble(pending)
            except TransferError as e:
                self._break(TransferFailed(f"{e}; the teacher may have dropped this session (see its log)"))
                return
            with self._cond:
                self._pending.popleft()
                self._cond.notify_all()
            pending.future.set_result(result)

    def _assemble(self, pending: _Pending) -> TeacherOutput:
        if self.backend == "nccl":
            consumer = torch.cuda.current_stream(self.device)
            for buffer in pending.buffers:  # freed later by the training loop's stream
                buffer.record_stream(consumer)
            buffers = pending.buffers
        else:
            buffers = [t.to(self.device) for t in pending.buffers]
        out = TeacherOutput(batch_id=pending.batch_id)
        if self.logits:
            out.logits = buffers.pop(0)
        if self.topk:
            out.topk_values, out.topk_indices = buffers.pop(0), buffers.pop(0)
        if self.hidden_layers:
            stacked = buffers.pop(0)
            out.hidden_states = {layer: stacked[i] for i, layer in enumerate(self.hidden_layers)}
        return out

    # ---- plumbing ----------------------------------------------------------------

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.rpc_timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"{method} to teacher {self.address}") from None

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                self._call("Heartbeat", pb.HeartbeatRequest(session_id=self.session_id))
            except TeacherError as e:
                if self._stop.is_set():
                    return
                log.warning("heartbeat failed: %s", e)
                if e.code == grpc.StatusCode.NOT_FOUND:
                    self._break(e)
                    return

    def _leave(self, drain: bool) -> None:
        if not self.session_id:
            return
        try:
            self._call("Leave", pb.LeaveRequest(session_id=self.session_id, drain=drain))
        except TeacherError as e:
            log.debug("leave: %s", e)

    def _break(self, error: TeacherError) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = error
            self._cond.notify_all()
        if self._group is not None:
            self._group.abort()
        self._fail_pending(error)

    def _fail_pending(self, error: TeacherError) -> None:
        with self._cond:
            failed, self._pending = list(self._pending), deque()
        for pending in failed:
            if not pending.future.done():
                pending.future.set_exception(error)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise TeacherError("the client is closed")

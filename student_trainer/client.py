"""TeacherClient: how a training process gets the teacher's outputs.

    with TeacherClient("host:50051", device="cuda:1", outputs=(Logits(),)) as teacher:
        fut = teacher.submit(input_ids, attention_mask)   # returns at once
        out = fut.result(timeout=60)                       # TeacherOutput

Join tells the client every shape it will receive, so right after a batch is
registered the client allocates its output buffers and posts the receives; the
teacher's sends land in them in submit order. A completion thread waits for each
batch's receives (with a deadline) and resolves its future. At most `max_inflight`
batches are outstanding: `submit` blocks beyond that (backpressure, not memory).

When the teacher goes away (UNAVAILABLE, a broken session group, NOT_FOUND for our
session after a restart) the client joins again, with backoff, for up to
`reconnect_timeout_s`, and sends the new session every batch whose outputs it has not
delivered, in submit order: each future resolves exactly once, later than it would
have. A refusal (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED,
UNAUTHENTICATED) is final, as before. Batch ids restart at 0 on every session (see
SubmitRequest.batch_id); `TeacherOutput.batch_id` is the client's own id, which does not.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch

from distill_common import tracing, wire
from distill_common.channel import TeacherUnreachable, channel_credentials, open_channel, wait_until_reachable
from distill_common.outputs import Logits, Output, OutputRequest, TeacherOutput, output_spec
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from distill_common.session_group import (STUDENT_RANK, SessionGroup, TransferError, build_group, connect_store,
                                          device_uuid, handshake, local_address_towards, mark_refused,
                                          nccl_version, prefix_token, ready_store_of)
from distill_common.vocab import tokenizer_fingerprint
from student_trainer.errors import (Incompatible, TeacherError, TeacherUnavailable, TransferFailed, from_rpc_error,
                                    from_status, teacher_gone)

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
class _Batch:
    """One submitted batch, from `submit` until its future is resolved (exactly once).

    Keeps its encoded request: after a teacher restart it is sent again, to the new session.
    """

    batch_id: int  # the client's own id: 0, 1, 2, ... in submit order, across reconnects
    shape: tuple[int, int]
    request: pb.SubmitRequest  # the ids and the mask; session_id and batch_id are set per session
    future: Future


@dataclass
class _Pending:
    """A batch sent on one session: its id on that session's wire and its receives."""

    batch: _Batch
    session: "_Session"
    wire_id: int  # SubmitRequest.batch_id on this session: 0, 1, 2, ... from its Join
    buffers: list[torch.Tensor] = field(default_factory=list)
    works: list = field(default_factory=list)

    @property
    def batch_id(self) -> int:
        return self.batch.batch_id

    @property
    def shape(self) -> tuple[int, int]:
        return self.batch.shape

    @property
    def future(self) -> Future:
        return self.batch.future


class _Session:
    """One Join: the session's group, its submit stream, and the three threads that serve it.

    When the teacher goes away the session is `lost`: its stream is cancelled and its group
    aborted, and whatever its threads still finish is dropped (see TeacherClient._resolve).
    The client joins again as a new _Session, with threads of its own, so a thread stuck on
    the old teacher holds nothing up.
    """

    def __init__(self, joined: pb.JoinResponse, group: SessionGroup, store, wait_store, wake_store):
        self.joined = joined
        self.session_id = joined.session_id
        self.group = group
        self.store = store  # keeps the connection the group uses alive
        # The receive thread waits for announcements on a connection of its own: a store
        # client runs one operation at a time, so a mark made on the same connection to
        # end that wait (see TeacherClient._wake) would queue behind the wait itself.
        self.wait_store = wait_store
        self.wake_store = wake_store  # the ready store on the group's own connection
        self.waiting_on: int | None = None  # the wire id the receive thread waits for
        self.requests: queue.Queue = queue.Queue()  # what the submit stream sends; None ends it
        self.responses = None  # the SubmitStream call
        # The teacher answers only refused batches (else every batch) on the submit stream.
        self.refusals_only = joined.stream_refusals_only
        self.sent: dict[int, _Pending] = {}  # by wire id: streamed, not yet answered or announced
        self.to_receive: queue.Queue = queue.Queue()  # to wait for, in order; receives not yet posted
        self.pending: deque[_Pending] = deque()  # receives posted, in order
        self.next_wire_id = 0
        self.lost = False
        self.retired = False
        self.threads: list[threading.Thread] = []


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

# Reconnecting: the first pause, doubled after each failed attempt up to the cap, each
# drawn down by up to half (jitter: the jobs of one teacher do not come back in lockstep).
_RECONNECT_FIRST_DELAY_S = 0.5
_RECONNECT_MAX_DELAY_S = 5.0
# Join answers worth retrying while reconnecting, besides the teacher being gone: a
# teacher still starting up, or still full of sessions whose leases will expire.
# Besides a teacher that is gone (errors.teacher_gone): one too slow to answer, or full
# (--max-sessions), may take the session a little later.
_REJOIN_ALSO_ON = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED})


def _worth_retrying(error: Exception) -> bool:
    """Whether joining again may go otherwise: the teacher is not up (yet), or the group did not form."""
    if isinstance(error, TeacherError):
        return teacher_gone(error) or error.code in _REJOIN_ALSO_ON
    # The store or the group: ConnectionError from connect_store, TransferError or a DistError
    # (a RuntimeError) from building the group.
    return isinstance(error, (ConnectionError, RuntimeError))


def _grpc_options() -> list:
    # A restarted teacher is dialled again within a second or two: grpc's own reconnect
    # backoff would grow to two minutes, longer than a restart takes.
    return [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]


class TeacherClient:
    def __init__(self, address: str, device: str | torch.device = "cpu", *, outputs: Iterable[Output] = (Logits(),),
                 dtype: str | None = None, max_inflight: int = 0, job_id: str | None = None,
                 job_rank: int | None = None, tokenizer=None, vocab_size: int = 0, weight: float = 1.0,
                 rpc_timeout_s: float = 30.0, auth_token: str | None = None,
                 join_timeout_s: float = 120.0, transfer_timeout_s: float | None = None,
                 tls_ca: str | bool | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 reconnect_timeout_s: float = 300.0):
        """`outputs`: the kinds of teacher output to receive (distill_common.outputs: Logits(),
        TopK(k), HiddenStates(layers)), in `dtype` (None: the teacher's).

        `tls_ca`: talk TLS to a teacher started with --tls-cert, trusting this PEM CA bundle
        (True: the system's roots). `tls_cert`/`tls_key`: this client's certificate, for a
        teacher started with --tls-client-ca. The data plane is not encrypted either way.

        `reconnect_timeout_s`: how long to keep trying to join again after the teacher went
        away (a restart, a crash, a network cut) before failing the outstanding batches
        with TeacherUnavailable; 0 fails them at once. The default, 5 minutes, covers a
        restart that reloads a large model; a job that would rather fail fast lowers it."""
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
        self._submit_lock = threading.Lock()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.session_id = ""
        self.reconnect_timeout_s = reconnect_timeout_s
        self.join_timeout_s = join_timeout_s
        self.reconnects = 0  # joins after the first, each after the teacher went away
        self._session: _Session | None = None
        # Every batch whose future is not resolved, by its client id, in submit order: what a
        # new session is sent after a reconnect. Resolving takes a batch out (_resolve).
        self._undelivered: dict[int, _Batch] = {}
        self._next_batch_id = 0  # the client's own batch ids (see _Batch.batch_id)

        fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""
        request = pb.JoinRequest(
            job_id=job_id or os.environ.get("TORCHELASTIC_RUN_ID", "") or f"pid{os.getpid()}",
            job_rank=int(os.environ.get("RANK", "0")) if job_rank is None else job_rank,
            outputs=output_spec(outputs, dtype),
            peer=pb.PeerInfo(device_type=self.device.type, device_uuid=device_uuid(self.device),
                             torch_version=torch.__version__,
                             nccl_version=nccl_version() if self.device.type == "cuda" else ""),
            max_inflight=max_inflight, tokenizer_fingerprint=fingerprint, stream_refusals_only=True,
            # The width of the student's logits (its output embedding's rows), which may
            # exceed len(tokenizer): models pad it. Without it, no size check is made.
            vocab_size=vocab_size, weight=weight)
        self._join_request = request
        self._wait_for_server(join_timeout_s)
        joined = self._call("Join", request)
        self.info = TeacherInfo.from_proto(joined.info)
        self.backend = joined.backend
        self.max_inflight = joined.max_inflight
        self.output_dtype = wire.parse_output_dtype(joined.output_dtype)
        self.outputs = OutputRequest.granted(request.outputs, joined)
        self._transfer_timeout_arg = transfer_timeout_s
        self.transfer_timeout_s = transfer_timeout_s or joined.timeout_s
        self.heartbeat_interval_s = joined.heartbeat_interval_s
        self._slots = threading.Semaphore(self.max_inflight)
        # A join after a restart asks for what this one was granted: the slots are sized by it.
        self._join_request.max_inflight = self.max_inflight
        try:
            session = self._connect(joined, join_timeout_s)
        except BaseException:
            self._leave(joined.session_id)
            self._channel.close()
            raise
        self._session = session
        self._start(session)
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="teacher-heartbeat", daemon=True)
        self._heartbeat_thread.start()
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
        tracing.mark("s_submit", self._next_batch_id)
        self._acquire_slot(wait_s)
        future: Future = Future()
        future.add_done_callback(lambda _: self._slots.release())
        request = pb.SubmitRequest(input_ids=ids)
        if mask is not None:
            request.attention_mask.CopyFrom(mask)
        with self._submit_lock:  # client ids, each session's wire ids and its stream in one order
            with self._cond:
                error = self._broken or (TeacherError("the client is closed") if self._closed else None)
                if error is None:
                    batch = _Batch(self._next_batch_id, tuple(input_ids.shape), request, future)
                    self._next_batch_id += 1
                    self._undelivered[batch.batch_id] = batch
                    session = None if self._session.lost else self._session
            if error is not None:
                future.set_exception(error)  # frees the slot
                raise error
            if session is not None:  # else a reconnect is under way: it sends the batch to the new session
                self._send(session, batch)
        return future

    def _acquire_slot(self, wait_s: float) -> None:
        """Takes one of max_inflight slots within `wait_s`; time spent reconnecting does not count
        (reconnect_timeout_s bounds it, and a failed reconnect frees every slot)."""
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            if self._slots.acquire(timeout=min(0.25, max(0.0, deadline - now))):
                return
            self._check_usable()
            if self._reconnecting:
                deadline += time.monotonic() - now
            elif time.monotonic() >= deadline:
                raise TeacherUnavailable(f"no batch finished within {wait_s:.0f}s while {self.max_inflight} were "
                                         "in flight: the teacher is overloaded or stuck", grpc.StatusCode.UNAVAILABLE)

    @property
    def _reconnecting(self) -> bool:
        return self._session.lost and self._broken is None and not self._stop.is_set()

    def _send(self, session: _Session, batch: _Batch) -> None:
        """Puts `batch` on `session`'s stream under the session's next wire id (hold _submit_lock)."""
        request = batch.request
        if request.session_id:  # sent before, to a session since lost, whose stream may still read it
            request = pb.SubmitRequest()
            request.CopyFrom(batch.request)
        request.session_id = session.session_id
        request.batch_id = session.next_wire_id
        pending = session.sent[session.next_wire_id] = _Pending(batch, session, session.next_wire_id)
        session.next_wire_id += 1  # used up, accepted or refused (see SubmitRequest.batch_id)
        session.requests.put(request)
        if session.refusals_only:  # no answer comes for an accepted batch: wait for its announcement now
            session.to_receive.put(pending)

    def _resolve(self, batch: _Batch, session: _Session | None = None, result: TeacherOutput | None = None,
                 error: BaseException | None = None) -> bool:
        """Resolves `batch`'s future unless it was resolved already or `session` is no longer current.

        The one place a future is resolved: taking the batch out of _undelivered under the
        lock decides it, so a batch is delivered once, and once delivered never sent again.
        """
        with self._cond:
            if session is not None and (session.lost or session is not self._session):
                return False  # a reconnect sends the batch again, or has already
            if self._undelivered.pop(batch.batch_id, None) is None:
                return False
            self._cond.notify_all()  # close() waits for _undelivered to empty
        if error is None:
            batch.future.set_result(result)
        else:
            batch.future.set_exception(error)
        return True

    def _request_stream(self, requests: queue.Queue):
        while True:
            request = requests.get()
            if request is None:
                return
            tracing.mark("s_yield", request.batch_id)
            yield request

    def _ack_loop(self, session: _Session) -> None:
        """Reads the teacher's answers to the session's streamed batches, in order: every
        batch's, or only the refused ones' (session.refusals_only)."""
        what = f"the submit stream to teacher {self.address}"
        try:
            for response in session.responses:
                with self._submit_lock:
                    pending = session.sent.pop(response.batch_id, None)
                if pending is None:
                    self._session_failed(session, TeacherError(
                        f"{what} answered batch {response.batch_id}, which awaits no answer (client and teacher "
                        "disagree on the protocol: run the same version on both sides)"))
                    return
                tracing.mark("s_ack", pending.wire_id)
                if not response.error_code:
                    if not session.refusals_only:
                        session.to_receive.put(pending)
                    continue
                if session.refusals_only and (session.waiting_on is None or session.waiting_on <= pending.wire_id):
                    # The receive thread waits for this batch, or will: the teacher marks most
                    # refusals itself, not one whose batch id it did not take (out of order).
                    self._wake(session, pending.wire_id)
                code = _STATUS_BY_NUMBER.get(response.error_code, grpc.StatusCode.UNKNOWN)
                error = from_status(code, response.error_message, f"Submit to teacher {self.address}")
                if code == grpc.StatusCode.NOT_FOUND:  # the teacher no longer knows this session
                    self._session_failed(session, error)
                    return
                self._resolve(pending.batch, session, error=error)
            error = TeacherUnavailable(f"{what} ended: the teacher closed it", grpc.StatusCode.UNAVAILABLE)
        except grpc.RpcError as e:
            error = from_rpc_error(e, what)
        self._session_failed(session, error)

    @staticmethod
    def _wake(session: _Session, wire_id: int) -> None:
        """Ends the receive thread's wait for `wire_id` (marked refused: it receives nothing)."""
        try:
            mark_refused(session.wake_store, wire_id)
        except Exception as e:  # the teacher's store is gone: that wait fails by itself
            log.debug("could not end the wait for batch %d: %s", wire_id, e)

    def _receive_loop(self, session: _Session) -> None:
        """Posts each batch's receives, in order, once the teacher announced its sends."""
        while True:
            pending = session.to_receive.get()
            if pending is None:
                return
            session.waiting_on = pending.wire_id  # before the check: _retire reads it after setting retired
            if session.retired:
                return
            try:
                announced = session.group.await_announced(pending.wire_id, self.transfer_timeout_s)
                session.waiting_on = None
                if session.retired:
                    return
                if not announced:
                    continue  # refused: the ack thread fails its future with the teacher's reason
                if session.refusals_only:
                    with self._submit_lock:
                        session.sent.pop(pending.wire_id, None)
                tracing.mark("s_announced", pending.wire_id)
                self._post_receives(pending)
                tracing.mark("s_posted", pending.wire_id)
            except Exception as e:
                self._session_failed(session, TransferFailed(f"receiving batch {pending.batch_id}: {e}"))
                return
            with self._cond:
                session.pending.append(pending)
                self._cond.notify_all()

    def close(self, timeout_s: float | None = None) -> None:
        """Waits for outstanding batches (at most `timeout_s`), leaves, frees the group."""
        if self._closed:
            return
        deadline = time.monotonic() + (self.transfer_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while self._undelivered and self._broken is None and time.monotonic() < deadline:
                self._cond.wait(0.05)
        self._closed = True
        self._stop.set()
        with self._cond:
            session = self._session  # a reconnect that finishes now sees _stop and retires its session itself
            self._cond.notify_all()
        session.requests.put(None)  # ends the stream: the ack thread sees it end
        session.to_receive.put(None)
        for thread in session.threads:
            thread.join(timeout=5)
        self._leave(session.session_id, timeout_s=min(self.rpc_timeout_s, 5.0))
        self._retire(session)
        self._channel.close()  # cancels a heartbeat in flight
        # Threads end here, not during interpreter shutdown: a daemon thread that drops the
        # last reference to a process group then runs its destructor without a GIL to take
        # back, and the process aborts ("terminate called without an active exception").
        self._heartbeat_thread.join(timeout=5)
        for thread in session.threads:
            thread.join(timeout=5)
        self._fail_undelivered(TeacherError("the client was closed before this batch arrived"))

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

    def _connect(self, joined: pb.JoinResponse, timeout_s: float) -> _Session:
        store = connect_store(joined.store_host, joined.store_port, timeout_s)
        # The address the teacher reaches this process at, where gloo listens (NCCL finds its own).
        local_host = local_address_towards(joined.store_host, joined.store_port)
        group = build_group(store, joined.store_prefix, backend=joined.backend, rank=STUDENT_RANK,
                            device=self.device, timeout_s=timeout_s, gloo_host=local_host)
        try:
            handshake(group, prefix_token(joined.store_prefix), timeout_s)
            wait_store = connect_store(joined.store_host, joined.store_port, timeout_s)
        except BaseException:
            group.abort()
            raise
        wake_store, group.ready_store = group.ready_store, ready_store_of(wait_store, joined.store_prefix)
        return _Session(joined, group, store, wait_store, wake_store)

    def _start(self, session: _Session) -> None:
        """Starts the threads and the submit stream of `session` (already made current)."""
        self.session_id = session.session_id
        # One stream carries every Submit of the session: no round trip per batch.
        session.responses = self._stub.SubmitStream(self._request_stream(session.requests), metadata=self._metadata)
        session.threads = [
            threading.Thread(target=self._completion_loop, args=(session,), name="teacher-recv", daemon=True),
            threading.Thread(target=self._ack_loop, args=(session,), name="teacher-acks", daemon=True),
            threading.Thread(target=self._receive_loop, args=(session,), name="teacher-post-recv", daemon=True)]
        for thread in session.threads:
            thread.start()

    # ---- reconnecting ------------------------------------------------------------

    def _session_failed(self, session: _Session, error: TeacherError) -> None:
        """A thread of `session` hit `error`: join again if the teacher went away, else fail for good."""
        with self._cond:
            if session.lost or self._stop.is_set() or self._broken is not None:
                return  # handled already, or closing
            session.lost = True
            self._cond.notify_all()
        self._retire(session)
        if self.reconnect_timeout_s <= 0 or not teacher_gone(error):
            self._break(error)
            return
        threading.Thread(target=self._reconnect, args=(session, error), name="teacher-reconnect", daemon=True).start()

    def _retire(self, session: _Session) -> None:
        """Ends a session's stream and threads and frees its group, without waiting for the teacher."""
        with self._cond:
            if session.retired:
                return
            session.retired = True
            self._cond.notify_all()  # its completion thread returns
        session.requests.put(None)
        session.to_receive.put(None)
        waiting_on = session.waiting_on
        if waiting_on is not None:  # the receive thread waits: end it (joined with the session's threads)
            wake = threading.Thread(target=self._wake, args=(session, waiting_on), name="teacher-wake", daemon=True)
            wake.start()  # off this thread: a store that stopped answering must not hold us up
            session.threads.append(wake)
        if session.responses is not None:
            session.responses.cancel()
        session.group.abort()  # a receive blocked on the old teacher returns

    def _reconnect(self, lost: _Session, cause: TeacherError) -> None:
        """Joins again and sends the new session every undelivered batch, or fails them all.

        Retries with exponential backoff (jittered, capped) for at most reconnect_timeout_s.
        A refusal that retrying would not change (a different model, a wrong token) ends it
        at once.
        """
        start = time.monotonic()
        deadline = start + self.reconnect_timeout_s
        log.warning("lost teacher %s (session %s): %s; joining again for up to %gs (reconnect_timeout_s)",
                    self.address, lost.session_id, cause, self.reconnect_timeout_s)
        # A teacher that is still up (it dropped the session, or the network blinked) frees its slot.
        self._leave(lost.session_id, timeout_s=min(self.rpc_timeout_s, 5.0))
        delay_s, attempt, last = _RECONNECT_FIRST_DELAY_S, 0, cause
        while not self._stop.is_set():
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            attempt += 1
            try:
                session = self._rejoin(deadline)
            except Exception as e:
                if self._stop.is_set():
                    return  # closed meanwhile (its channel too)
                if not _worth_retrying(e):
                    what = f"joining teacher {self.address} again after it was lost ({cause})"
                    self._break(type(e)(f"{what}: {e}", e.code) if isinstance(e, TeacherError)
                                else TeacherError(f"{what}: {type(e).__name__}: {e}"))
                    return
                last = e
                pause_s = min(max(0.0, deadline - time.monotonic()), delay_s * random.uniform(0.5, 1.0))
                log.warning("reconnect attempt %d to teacher %s failed, %.1fs after losing it: %s; next in %.1fs",
                            attempt, self.address, time.monotonic() - start, e, pause_s)
                self._stop.wait(pause_s)
                delay_s = min(2 * delay_s, _RECONNECT_MAX_DELAY_S)
                continue
            try:
                resent = self._install(session)
            except Exception:
                if self._stop.is_set():
                    return  # closed while starting the new session
                raise
            if resent is not None:
                log.info("reconnected to teacher %s as session %s after %.1fs (attempt %d); re-submitted %d batches",
                         self.address, session.session_id, time.monotonic() - start, attempt, resent)
            return
        if self._stop.is_set():
            return
        self._break(TeacherUnavailable(
            f"teacher {self.address} did not come back within reconnect_timeout_s={self.reconnect_timeout_s:g}s "
            f"(the trainer's --teacher-reconnect-timeout-s); it was lost: {cause}; last attempt: {last}. Restart "
            "the teacher, or raise that timeout to ride out longer outages", grpc.StatusCode.UNAVAILABLE))

    def _rejoin(self, deadline: float) -> _Session:
        """One attempt: Join with the first Join's request, check the teacher serves the same, form the group."""
        joined = self._call("Join", self._join_request, timeout_s=max(0.1, min(self.rpc_timeout_s,
                                                                              deadline - time.monotonic())))
        try:
            self._check_same_teacher(joined)
            # The group forms in about a second; a last attempt gets that much even past the deadline.
            return self._connect(joined, min(self.join_timeout_s, max(1.0, deadline - time.monotonic())))
        except BaseException:
            self._leave(joined.session_id, timeout_s=min(self.rpc_timeout_s, 5.0))
            raise

    def _check_same_teacher(self, joined: pb.JoinResponse) -> None:
        info = TeacherInfo.from_proto(joined.info)
        changed = [f"{name} {getattr(self.info, name)} -> {getattr(info, name)}"
                   for name in ("vocab_size", "hidden_size", "num_layers")
                   if getattr(info, name) != getattr(self.info, name)]
        if joined.backend != self.backend:
            changed.append(f"backend {self.backend} -> {joined.backend}")
        if wire.parse_output_dtype(joined.output_dtype) != self.output_dtype:
            changed.append(f"output dtype {self.output_dtype} -> {joined.output_dtype}")
        if changed:
            raise Incompatible(f"the teacher came back different ({', '.join(changed)}): its outputs would not "
                               "continue this run; restart the job against it", grpc.StatusCode.FAILED_PRECONDITION)
        if info.model_name != self.info.model_name:
            log.warning("teacher %s came back serving %s (was %s)", self.address, info.model_name,
                        self.info.model_name)

    def _install(self, session: _Session) -> int | None:
        """Makes `session` current and sends it every undelivered batch, in submit order.

        Returns how many were sent, or None when the client was closed or broken meanwhile.
        """
        with self._submit_lock:  # no submit in between: it would go to the lost session or be sent twice
            with self._cond:
                abandoned = self._stop.is_set() or self._broken is not None
                if not abandoned:
                    self._session = session
                    batches = list(self._undelivered.values())
            if abandoned:
                self._retire(session)
                self._leave(session.session_id, timeout_s=min(self.rpc_timeout_s, 5.0))
                return None
            self.heartbeat_interval_s = session.joined.heartbeat_interval_s
            if self._transfer_timeout_arg is None:
                self.transfer_timeout_s = session.joined.timeout_s
            self._start(session)
            for batch in batches:
                self._send(session, batch)
        self.reconnects += 1
        return len(batches)

    # ---- receiving ---------------------------------------------------------------

    def _post_receives(self, pending: _Pending) -> None:
        # On a stream of the group's own (NCCL): see SessionGroup.post_receives.
        pending.buffers, pending.works = pending.session.group.post_receives(self.outputs.layout(*pending.shape))

    def _completion_loop(self, session: _Session) -> None:
        while True:
            with self._cond:
                while not session.pending and not session.lost and not self._stop.is_set():
                    self._cond.wait(0.1)
                if session.lost or not session.pending:
                    return
                pending = session.pending[0]
            try:
                for work in pending.works:
                    session.group.wait(work, self.transfer_timeout_s, what=f"receiving batch {pending.batch_id}")
                tracing.mark("s_received", pending.wire_id)
                result = self._assemble(pending)
            except TransferError as e:
                self._session_failed(session, TransferFailed(
                    f"{e}; the teacher may have dropped this session (see its log)"))
                return
            with self._cond:
                if session.pending and session.pending[0] is pending:
                    session.pending.popleft()
                self._cond.notify_all()
            self._resolve(pending.batch, session, result=result)
            tracing.mark("s_resolved", pending.wire_id)

    def _assemble(self, pending: _Pending) -> TeacherOutput:
        tensors = pending.session.group.delivered(pending.buffers)  # on self.device, for the training loop's stream
        return self.outputs.assemble(pending.batch_id, tensors)  # the client's id, not the session's wire id

    # ---- plumbing ----------------------------------------------------------------

    def _call(self, method: str, request, timeout_s: float | None = None):
        timeout_s = self.rpc_timeout_s if timeout_s is None else timeout_s
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"{method} to teacher {self.address}") from None

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            session = self._session
            if self._broken is not None:
                return
            if session.lost:
                continue  # reconnecting: the next session's lease starts at its Join
            try:
                self._call("Heartbeat", pb.HeartbeatRequest(session_id=session.session_id))
            except TeacherError as e:
                if self._stop.is_set():
                    return
                log.warning("heartbeat failed: %s", e)
                # Without a reconnect to try, one unanswered heartbeat is not worth failing for:
                # the stream and the data plane tell when the teacher is really gone.
                if e.code == grpc.StatusCode.NOT_FOUND or (e.code == grpc.StatusCode.UNAVAILABLE
                                                           and self.reconnect_timeout_s > 0):
                    self._session_failed(session, e)

    def _leave(self, session_id: str, timeout_s: float | None = None) -> None:
        if not session_id:
            return
        try:
            self._call("Leave", pb.LeaveRequest(session_id=session_id, drain=False), timeout_s)
        except TeacherError as e:
            log.debug("leave: %s", e)

    def _break(self, error: TeacherError) -> None:
        """Fails the client for good: every undelivered batch and every later submit get `error`."""
        with self._cond:
            if self._broken is None:
                self._broken = error
            session = self._session
            if session is not None:
                session.lost = True
            self._cond.notify_all()
        if session is not None:
            self._retire(session)
        self._fail_undelivered(self._broken)

    def _fail_undelivered(self, error: TeacherError) -> None:
        with self._cond:
            failed = list(self._undelivered.values())
            self._undelivered.clear()
        for batch in failed:
            batch.future.set_exception(error)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise TeacherError("the client is closed")

"""What TeacherClient and its joining procedure share: the client's link to the teacher.

TeacherClient (student_trainer/client.py) is what a training process calls; joining,
noticing a failure and joining again (student_trainer/joining.py) run on its threads. Both
act on what is here, and nothing else of each other: the channel to the teacher
(`TeacherChannel`), what the first Join granted, the connection's state machine
(student_trainer/connection.py) and the batches not yet delivered, under the two locks
that order them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from distill_common.channel import (SESSION_SECRET_KEY, TeacherUnreachable, channel_credentials, open_channel,
                                    wait_until_reachable)
from distill_common.outputs import JoinData, OutputRequest
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from distill_common.quantization import Quantization
from student_trainer.connection import Connection, State
from student_trainer.errors import TeacherError, TeacherUnavailable, from_rpc_error
from student_trainer.session import Batch, Session

# The client's logger: what a TeacherClient says about its connection is one log, whichever module says it.
log = logging.getLogger("student_trainer.client")


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
    quantization: Quantization = Quantization()  # what the teacher's decoder linears run in (FP8, or its dtype)
    weights_fingerprint: str = ""  # the weights as served: the same on every replica of a pool

    @classmethod
    def from_proto(cls, info: pb.TeacherInfo) -> "TeacherInfo":
        return cls(model_name=info.model_name, architecture=info.architecture, vocab_size=info.vocab_size,
                   hidden_size=info.hidden_size, num_layers=info.num_layers, dtype=info.dtype,
                   tokenizer_fingerprint=info.tokenizer_fingerprint, max_batch_tokens=info.max_batch_tokens,
                   max_seq_len=info.max_seq_len, quantization=Quantization.from_info(info.quantization),
                   weights_fingerprint=info.weights_fingerprint)


def _grpc_options() -> list:
    # A restarted teacher is dialled again within a second or two: grpc's own reconnect
    # backoff would grow to two minutes, longer than a restart takes.
    return [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]


class TeacherChannel:
    """The gRPC channel to one teacher, and every call made on it (with the job's token, and the
    session's secret for a call about a session)."""

    def __init__(self, address: str, rpc_timeout_s: float, token: str, *, tls_ca: str | bool | None,
                 tls_cert: str | None, tls_key: str | None):
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self._tls = bool(tls_ca)
        self._channel = open_channel(address, channel_credentials(tls_ca, tls_cert, tls_key), _grpc_options())
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._stub = pb_grpc.TeacherServiceStub(self._channel)

    def wait_for_server(self, timeout_s: float) -> None:
        try:  # a TLS mismatch is reported at once, with the argument to change
            wait_until_reachable(self._channel, self.address, timeout_s, tls=self._tls)
        except TeacherUnreachable as e:
            self._channel.close()
            raise TeacherUnavailable(str(e)) from None

    @staticmethod
    def _secret(joined: pb.JoinResponse) -> tuple:
        """The metadata that lets a call act on the session `joined`: its secret."""
        return ((SESSION_SECRET_KEY, joined.session_secret),)

    def call(self, method: str, request, timeout_s: float | None = None, joined: pb.JoinResponse | None = None):
        """`joined`: the session the call is about, whose secret it carries."""
        timeout_s = self.rpc_timeout_s if timeout_s is None else timeout_s
        metadata = self._metadata if joined is None else self._metadata + self._secret(joined)
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"{method} to teacher {self.address}") from None

    def submit_stream(self, joined: pb.JoinResponse):
        """Opens the session's submit stream: a function of the request iterator."""
        metadata = self._metadata + self._secret(joined)
        return lambda requests: self._stub.SubmitStream(requests, metadata=metadata)

    def leave(self, joined: pb.JoinResponse, timeout_s: float | None = None) -> TeacherError | None:
        """Leaves the session; the teacher's error, if any (NOT_FOUND names why it had ended it)."""
        if not joined.session_id:
            return None
        try:
            self.call("Leave", pb.LeaveRequest(session_id=joined.session_id, drain=False), timeout_s, joined=joined)
        except TeacherError as e:
            log.debug("leave: %s", e)
            return e
        return None

    def close(self) -> None:
        self._channel.close()  # cancels a call in flight


class Link:
    """The client's link to the teacher (see the module's docstring). What the first Join granted
    (`info` .. `joined`) is set once it is granted; `connection` once the first session formed."""

    def __init__(self, channel: TeacherChannel, device: torch.device, join_request: pb.JoinRequest, *,
                 join_timeout_s: float, reconnect_timeout_s: float, transfer_timeout_s: float | None):
        self.channel = channel
        self.device = device
        self.join_request = join_request  # what every Join asks, the first and each after a restart
        self.join_timeout_s = join_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.transfer_timeout_arg = transfer_timeout_s  # None: each session's, as its Join grants
        self.submit_lock = threading.Lock()  # client ids, each session's wire ids and its stream in one order
        self.cond = threading.Condition()  # the connection and `undelivered`
        # Every batch whose future is not resolved, by its client id, in submit order: what a
        # new session is sent after a reconnect. Resolving takes a batch out (`resolve`).
        self.undelivered: dict[int, Batch] = {}
        self.reconnects = 0  # joins after the first, each after the teacher went away
        # What the first Join granted.
        self.info: TeacherInfo | None = None
        self.backend = ""
        self.output_dtype: torch.dtype | None = None
        self.outputs: OutputRequest | None = None
        self.matched_student_ids: torch.Tensor | None = None  # cross-tokenizer: ProjectedNext's student ids
        self.joined: JoinData | None = None  # what the kinds asked sent once at join (the output head)
        self.transfer_timeout_s = 0.0
        self.heartbeat_interval_s = 0.0
        self.connection: Connection | None = None
        # The replicas `channel` is one of (student_trainer/pool.py): a rejoin may move to another.
        self.pool = None
        # After a rejoin, until the new session delivers its first batch: that session, when
        # (monotonic) the one before it was lost, and which it was, where. The outage is logged then.
        self.recovering: tuple[Session, float, str] | None = None

    def start(self, session: Session) -> None:
        """Opens the submit stream of `session` (already made current) and starts its threads."""
        # One stream carries every Submit of the session: no round trip per batch.
        session.start(self.channel.submit_stream(session.joined), self.transfer_timeout_s)

    def resolve(self, batch: Batch, session: Session, result=None, error: BaseException | None = None) -> bool:
        """Resolves `batch`'s future unless it was resolved already or `session` no longer serves.

        The one place a future is resolved: taking the batch out of `undelivered` under the
        lock decides it, so a batch is delivered once, and once delivered never sent again.
        """
        with self.cond:
            if not self.connection.serves(session):
                return False  # a reconnect sends the batch again, or has already
            if self.undelivered.pop(batch.batch_id, None) is None:
                return False
            self.cond.notify_all()  # close() waits for `undelivered` to empty
            recovered = self.recovering if error is None and self.recovering and self.recovering[0] is session else None
            if recovered is not None:
                self.recovering = None
        if recovered is not None:
            # The other end of the "lost teacher" warning, on every rank that gave it: how long
            # the session delivered nothing (detecting the loss, joining again, the first batch).
            _, lost_since, lost = recovered
            log.warning("teacher %s serving again: session %s delivered its first batch %.2fs after losing %s",
                        self.channel.address, session.session_id, time.monotonic() - lost_since, lost)
        if error is None:
            batch.future.set_result(result)
        else:
            batch.future.set_exception(error)
        return True

    def fail_undelivered(self, error: TeacherError) -> None:
        with self.cond:
            failed = list(self.undelivered.values())
            self.undelivered.clear()
        for batch in failed:
            batch.future.set_exception(error)

    def wait_closed(self, timeout_s: float) -> bool:
        """Sleeps `timeout_s`, less when the client is closed meanwhile; True when it is."""
        with self.cond:
            return self.cond.wait_for(lambda: self.connection.state is State.CLOSED, timeout_s)

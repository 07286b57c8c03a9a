"""`teacher-server status ADDRESS` and `teacher-server info ADDRESS`: a running teacher, as tables.

Their settings are `AdminConfig`'s fields; teacher_server/__main__.py parses them and turns
errors into exit codes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import grpc

from distill_common.channel import TlsFlags, channel_credentials, connection_hint, open_channel, tls_ca_arg
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from distill_common.quantization import Quantization
from distill_common.replicas import ReplicasError, replica_addresses, single
from distill_common.settings import ConfigError

TLS_FLAGS = TlsFlags(ca="--tls-ca", cert="--tls-cert", key="--tls-key")


@dataclass
class AdminConfig:
    timeout_s: float = field(default=10.0, metadata={"help": "how long to wait for the teacher's answer"})
    # repr=False: a secret, kept out of reprs.
    auth_token: str = field(default_factory=lambda: os.environ.get("TEACHER_AUTH_TOKEN", ""), repr=False,
                            metadata={"help": "the teacher's --auth-token (default: $TEACHER_AUTH_TOKEN)"})
    tls_ca: str = field(default="", metadata={"help": (
        "talk TLS to a teacher started with --tls-cert: the PEM CA that signed its certificate, or 'system' for "
        "the system's roots")})
    tls_cert: str = field(default="", metadata={"help": "client certificate (PEM), for a teacher with --tls-client-ca"})
    tls_key: str = field(default="", metadata={"help": "the key of --tls-cert (PEM)"})

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout-s {self.timeout_s} must be > 0")
        # Built once here so a missing file or a lone --tls-cert fails by flag name before any call.
        channel_credentials(tls_ca_arg(self.tls_ca), self.tls_cert or None, self.tls_key or None, TLS_FLAGS)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_info(info: pb.TeacherInfo) -> str:
    rows = [
        ["model", info.model_name], ["architecture", info.architecture], ["dtype", info.dtype],
        ["quantization", str(Quantization.from_info(info.quantization))],
        ["device", info.device_type], ["tensor parallel", str(info.tp_size)], ["vocab size", str(info.vocab_size)],
        ["hidden size", str(info.hidden_size)], ["layers", str(info.num_layers)],
        ["tokenizer", info.tokenizer_fingerprint[:16] or "(none: vocabularies are not checked)"],
        ["--max-batch-tokens", str(info.max_batch_tokens)], ["--max-seq-len", str(info.max_seq_len)],
        ["--max-sessions", str(info.max_sessions)], ["--max-inflight", str(info.max_inflight)],
        ["torch", info.torch_version], ["nccl", info.nccl_version or "-"],
        ["weights", info.weights_fingerprint[:16] or "-"],
    ]
    return _table(["field", "value"], rows)


def format_status(status: pb.StatusResponse) -> str:
    head = (f"{status.info.model_name}: {len(status.sessions)} session(s), queue depth {status.queue_depth}, "
            f"busy {status.busy_fraction:.0%}")
    if not status.sessions:
        return head + "\n(no sessions)"
    rows = [[s.session_id, s.job_id, str(s.job_rank), s.backend, s.state, str(s.tokens_served),
             f"{s.batches_sent}/{s.batches_submitted}", str(s.inflight), _bytes(s.bytes_sent),
             f"{s.last_heartbeat_age_s:.1f}s ago"] for s in status.sessions]
    return head + "\n" + _table(["session", "job", "rank", "backend", "state", "tokens", "batches sent",
                                 "in flight", "sent", "heartbeat"], rows)


class AdminError(RuntimeError):
    """The teacher could not be asked, or refused to answer; the message says why and what to change."""


def query(command: str, address: str, config: AdminConfig) -> str:
    """What `teacher-server COMMAND ADDRESS` prints: the status or the info of a teacher, as a
    table; of each replica of a pool (a comma list, dns:NAME:PORT, file:PATH: distill_common/replicas.py),
    one after another, a replica that does not answer saying so."""
    if single(address):
        return _query_one(command, address, config)
    try:
        replicas = replica_addresses(address)
    except ReplicasError as e:
        raise AdminError(str(e)) from None
    parts = []
    for replica in replicas:
        try:
            parts.append(f"== {replica}\n{_query_one(command, replica, config)}")
        except AdminError as e:
            parts.append(f"== {replica}\n(no answer: {e})")
    return "\n".join(parts)


def _query_one(command: str, address: str, config: AdminConfig) -> str:
    credentials = channel_credentials(tls_ca_arg(config.tls_ca), config.tls_cert or None, config.tls_key or None,
                                      TLS_FLAGS)
    metadata = (("authorization", f"Bearer {config.auth_token}"),) if config.auth_token else ()
    with open_channel(address, credentials) as channel:
        stub = pb_grpc.TeacherServiceStub(channel)
        try:
            if command == "info":
                return format_info(stub.GetInfo(pb.GetInfoRequest(), timeout=config.timeout_s, metadata=metadata))
            return format_status(stub.GetStatus(pb.GetStatusRequest(), timeout=config.timeout_s, metadata=metadata))
        except grpc.RpcError as e:
            hint = connection_hint(e.details() or "", bool(config.tls_ca), TLS_FLAGS, address) \
                if e.code() == grpc.StatusCode.UNAVAILABLE else ""
            raise AdminError(f"{address} answered {e.code().name}: {e.details()}" + (f"\n{hint}" if hint else "")) \
                from e

"""The teacher server's settings: one dataclass, checked once, errors that name the flag."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import ssl
from dataclasses import dataclass, field

from distill_common.channel import read_pem

log = logging.getLogger(__name__)

_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """A byte count: 123, 512MiB, 8GiB, 2GB (binary and decimal units)."""
    number = text.strip().lower()
    stripped = number.rstrip("kmgtib")
    digits, unit = stripped.strip(), number[len(stripped):]
    try:
        return int(float(digits) * _BYTE_UNITS[unit])
    except (KeyError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count: use e.g. 1073741824, 512MiB, 8GiB") from e


@dataclass
class ServerConfig:
    model: str = "builtin:tiny"
    device: str = "cpu"
    dtype: str = ""  # empty: the model's own dtype
    host: str = "0.0.0.0"
    port: int = 50051
    http_port: int = 8000
    store_port: int = 29600
    # The address students use to reach the store and the gloo data plane; empty
    # means this machine's hostname (or 127.0.0.1 when --host is loopback).
    advertise_host: str = ""
    max_batch_tokens: int = 16384
    max_seq_len: int = 8192
    max_sessions: int = 64
    max_inflight: int = 8
    # Bytes of forward outputs kept for identical batches of later sessions (0: off).
    # Held in teacher memory, on the teacher's device: see docs/scaling.md.
    cache_bytes: int = 0
    # Pack shapes whose forward is captured as a CUDA graph (teacher_server/cuda_graphs.py; 0: off).
    cuda_graphs: int = 0
    heartbeat_interval_s: float = 2.0
    lease_s: float = 30.0
    transfer_timeout_s: float = 120.0
    join_timeout_s: float = 60.0
    grace_period_s: float = 30.0
    # Tensor parallelism (torchrun with several ranks): the TP world's collective timeout,
    # and how long a rank waits for rank 0's next message (keep-alives keep it fed). Long:
    # loading a large model shard by shard waits for the slowest rank under it too.
    tp_timeout_s: float = 1800.0
    trust_remote_code: bool = False
    auth_token: str = field(default="", repr=False)
    # TLS for gRPC and HTTP (PEM files); with tls_client_ca, gRPC also requires client certificates.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    log_level: str = "INFO"
    log_format: str = "text"
    # Bounds on what a caller can hold, most of them before its token is checked
    # (teacher_server/edge.py, docs/security.md).
    # Largest gRPC request accepted; grpc itself refuses bigger ones (RESOURCE_EXHAUSTED).
    # 0: what a full batch needs (request_limit_bytes).
    max_request_bytes: int = 0
    # SubmitStream (and grpc.health Watch) streams open at once; 0: two per --max-sessions,
    # room for a reconnecting student whose old stream has not ended yet.
    max_streams: int = 0
    # Other calls of the teacher service in progress at once, and (counted apart) health
    # checks still waiting for their request; 0: four per --max-sessions plus 16 for joins
    # and operators.
    max_rpcs: int = 0
    # HTTP connections open at once; past it, a new connection closes the oldest one that
    # has not sent a complete request (so idle sockets cannot lock probes out).
    http_max_connections: int = 64
    # A HTTP connection that has not sent complete request headers this long after it opened
    # (or after its previous response) is closed.
    http_header_timeout_s: float = 10.0
    # Largest weight a job may declare at Join (its share of the forwards against other jobs).
    max_weight: float = 100.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"--device {self.device!r}: use cpu, cuda or cuda:N")
        if self.dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {self.dtype!r}: use float32, bfloat16 or float16 (or omit for the model's)")
        for name in ("port", "http_port", "store_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} {value} is not a TCP port (0..65535)")
        fixed_ports = [p for p in (self.port, self.http_port, self.store_port) if p]  # 0 = any free port
        if len(set(fixed_ports)) != len(fixed_ports):
            raise ValueError(f"--port, --http-port and --store-port must differ, got {self.port}, {self.http_port}, {self.store_port}")
        if self.max_seq_len < 1:
            raise ValueError("--max-seq-len must be >= 1")
        if self.max_batch_tokens < self.max_seq_len:
            raise ValueError(f"--max-batch-tokens ({self.max_batch_tokens}) must be >= --max-seq-len ({self.max_seq_len}): "
                             "otherwise a single full-length sequence could never be served")
        if self.max_sessions < 1 or self.max_inflight < 1:
            raise ValueError("--max-sessions and --max-inflight must be >= 1")
        if self.cache_bytes < 0:
            raise ValueError(f"--cache-bytes {self.cache_bytes} must be >= 0 (0 turns the output cache off)")
        if self.cuda_graphs < 0:
            raise ValueError(f"--cuda-graphs {self.cuda_graphs} must be >= 0 (0 turns CUDA graphs off)")
        if self.lease_s <= self.heartbeat_interval_s:
            raise ValueError(f"--lease-s ({self.lease_s}) must exceed --heartbeat-interval-s ({self.heartbeat_interval_s})")
        for name in ("transfer_timeout_s", "join_timeout_s", "grace_period_s", "tp_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_request_bytes and self.max_request_bytes < self.full_batch_bytes:
            raise ValueError(f"--max-request-bytes {self.max_request_bytes} is too small for a batch of "
                             f"--max-batch-tokens {self.max_batch_tokens} (int64 ids and mask): use at least "
                             f"{self.full_batch_bytes} (or 0 for that)")
        for name in ("max_request_bytes", "max_streams", "max_rpcs"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 0 "
                                 "(0: derived from the other limits)")
        if self.http_max_connections < 1:
            raise ValueError(f"--http-max-connections {self.http_max_connections} must be >= 1")
        if not self.http_header_timeout_s > 0:
            raise ValueError(f"--http-header-timeout-s {self.http_header_timeout_s} must be > 0")
        if not 1 <= self.max_weight < float("inf"):
            raise ValueError(f"--max-weight {self.max_weight} must be a finite number >= 1 (the default job weight)")
        self._check_tls()

    def _check_tls(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both (PEM certificate chain and its key) "
                             "or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client certificates only exist over TLS")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key),
                           ("--tls-client-ca", self.tls_client_ca)):
            if path:
                read_pem(path, flag)
        if self.tls_cert:
            try:  # a key that does not belong to the certificate is caught here, not at the first handshake
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.tls_cert, self.tls_key)
            except ssl.SSLError as e:
                raise ValueError(f"--tls-cert {self.tls_cert} and --tls-key {self.tls_key} do not form a usable "
                                 f"certificate and key pair: {e}") from e

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def full_batch_bytes(self) -> int:
        """A request carrying a full batch: int64 ids and mask (the widest the wire allows), plus
        64 KiB for framing, which also covers every other message."""
        return 2 * 8 * self.max_batch_tokens + (64 << 10)

    @property
    def request_limit_bytes(self) -> int:
        return self.max_request_bytes or self.full_batch_bytes

    @property
    def streams_limit(self) -> int:
        return self.max_streams or 2 * self.max_sessions

    @property
    def rpcs_limit(self) -> int:
        return self.max_rpcs or 4 * self.max_sessions + 16

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        d = cls()
        parser.add_argument("--model", default=d.model,
                            help="a local Hugging Face model directory, a hub id, or builtin:tiny (a small random Llama)")
        parser.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N")
        parser.add_argument("--dtype", default=d.dtype, choices=["", "float32", "bfloat16", "float16"],
                            help="the dtype to run the model in (default: the model's)")
        parser.add_argument("--host", default=d.host, help="address the gRPC and HTTP servers bind to")
        parser.add_argument("--port", type=int, default=d.port, help="gRPC port")
        parser.add_argument("--http-port", type=int, default=d.http_port, help="HTTP port (health, metrics, status)")
        parser.add_argument("--store-port", type=int, default=d.store_port,
                            help="TCPStore port on which session process groups form")
        parser.add_argument("--advertise-host", default=d.advertise_host,
                            help="address students use for the store and the gloo data plane (default: this host)")
        parser.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                            help="token budget of one forward (rows x padded length), and the largest batch accepted")
        parser.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="longest sequence accepted")
        parser.add_argument("--max-sessions", type=int, default=d.max_sessions, help="sessions served at once")
        parser.add_argument("--max-inflight", type=int, default=d.max_inflight,
                            help="batches a session may have queued or in transfer")
        parser.add_argument("--cache-bytes", type=parse_bytes, default=d.cache_bytes,
                            help="keep up to this many bytes of outputs (e.g. 8GiB) so identical batches of later "
                                 "sessions cost no forward; held on the teacher device (default 0: off)")
        parser.add_argument("--cuda-graphs", type=int, default=d.cuda_graphs, metavar="N",
                            help="replay the model's decoder from CUDA graphs for up to N pack shapes: for small "
                                 "teachers whose forward costs the host more than the device (one GPU, no "
                                 "tensor parallelism; default 0: off)")
        parser.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s)
        parser.add_argument("--lease-s", type=float, default=d.lease_s,
                            help="a session without a heartbeat for this long is dropped")
        parser.add_argument("--transfer-timeout-s", type=float, default=d.transfer_timeout_s,
                            help="a send to a student that takes longer fails that session")
        parser.add_argument("--join-timeout-s", type=float, default=d.join_timeout_s,
                            help="how long the teacher waits for a joining student's end of the group")
        parser.add_argument("--grace-period-s", type=float, default=d.grace_period_s,
                            help="on SIGTERM, how long in-flight batches may take to finish")
        parser.add_argument("--tp-timeout-s", type=float, default=d.tp_timeout_s,
                            help="tensor parallelism (torchrun, several ranks): a collective or a rank's wait for "
                                 "rank 0 that takes longer fails the teacher")
        parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub")
        parser.add_argument("--auth-token", default=os.environ.get("TEACHER_AUTH_TOKEN", ""),
                            help="require this shared token on every RPC but health, and on /v1/status "
                                 "(default: $TEACHER_AUTH_TOKEN; empty: no authentication)")
        parser.add_argument("--tls-cert", default=d.tls_cert,
                            help="PEM certificate chain: serve gRPC and HTTP over TLS (needs --tls-key)")
        parser.add_argument("--tls-key", default=d.tls_key, help="PEM private key of --tls-cert")
        parser.add_argument("--tls-client-ca", default=d.tls_client_ca,
                            help="PEM CA bundle: gRPC clients must present a certificate it signed (mutual TLS)")
        parser.add_argument("--log-level", default=d.log_level)
        parser.add_argument("--log-format", default=d.log_format, choices=["text", "json"],
                            help="json: one JSON object per line, with session_id on session records")
        parser.add_argument("--max-request-bytes", type=parse_bytes, default=d.max_request_bytes,
                            help="largest gRPC request accepted (bigger ones: RESOURCE_EXHAUSTED from grpc; "
                                 "default 0: what a batch of --max-batch-tokens needs)")
        parser.add_argument("--max-streams", type=int, default=d.max_streams,
                            help="submit streams open at once (default 0: 2 x --max-sessions)")
        parser.add_argument("--max-rpcs", type=int, default=d.max_rpcs,
                            help="other calls in progress at once, and health checks waiting for their request "
                                 "(default 0: 4 x --max-sessions + 16)")
        parser.add_argument("--http-max-connections", type=int, default=d.http_max_connections,
                            help="HTTP connections open at once; a new one closes the oldest idle one")
        parser.add_argument("--http-header-timeout-s", type=float, default=d.http_header_timeout_s,
                            help="close a HTTP connection that has not sent its request headers within this long")
        parser.add_argument("--max-weight", type=float, default=d.max_weight,
                            help="largest weight a job may ask for at join (its share of forwards against other jobs)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})

    def log_non_defaults(self) -> None:
        default = type(self)()
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(default, f.name) and f.name != "auth_token"}
        if self.auth_token:
            changed["auth_token"] = "(set)"
        log.info("teacher server settings (non-default): %s", changed or "none")

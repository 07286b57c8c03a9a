"""The client end of the control plane: a gRPC channel, plaintext or TLS, and a wait
for the teacher that tells a TLS mismatch apart from a teacher that is not up yet.

Used by `TeacherClient` and by `teacher-server status|info`. Each caller names its own
flags (`flags`), so the hints say what to change where the user typed it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distill_common.settings import ConfigError

# The gRPC metadata key under which every call about a session carries its secret
# (JoinResponse.session_secret): Submit, SubmitStream, Heartbeat, Leave. A session id alone
# is not enough: ids are shown in status and metrics.
SESSION_SECRET_KEY = "teacher-session-secret"


@dataclass(frozen=True)
class TlsFlags:
    """How the caller spells its TLS settings, for messages (default: TeacherClient's
    arguments and the trainer's flags that feed them)."""

    ca: str = "tls_ca / --teacher-tls-ca"
    cert: str = "tls_cert / --teacher-tls-cert"
    key: str = "tls_key / --teacher-tls-key"


class TeacherUnreachable(ConnectionError):
    """The teacher did not answer; the message says why as far as grpc told, and what to change."""


def read_pem(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from e
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag} {path} is not a PEM file (no -----BEGIN line)")
    return data


def tls_ca_arg(value: str) -> str | bool | None:
    """A --tls-ca style argument as channel_credentials takes it: "system" is the system's
    roots (True), a path is a PEM file, empty is plaintext (None)."""
    return True if value == "system" else value or None


def channel_credentials(tls_ca: str | bool | None, tls_cert: str | None = None, tls_key: str | None = None,
                        flags: TlsFlags = TlsFlags()) -> grpc.ChannelCredentials | None:
    """None for plaintext; TLS with `tls_ca` (a PEM path, or True for the system's roots).

    `tls_cert` and `tls_key` are the client's own certificate, for a teacher started
    with --tls-client-ca (mutual TLS).
    """
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError(f"{flags.cert} and {flags.key} go together: the client certificate and its key")
    if not tls_ca and not tls_cert:
        return None
    if not tls_ca:
        raise ConfigError(f"{flags.cert} needs {flags.ca} (the CA that signed the teacher's --tls-cert, "
                         "or the system's roots)")
    roots = None if tls_ca is True else read_pem(str(tls_ca), flags.ca)
    if tls_cert:
        return grpc.ssl_channel_credentials(roots, private_key=read_pem(tls_key, flags.key),
                                            certificate_chain=read_pem(tls_cert, flags.cert))
    return grpc.ssl_channel_credentials(roots)


def open_channel(address: str, credentials: grpc.ChannelCredentials | None, options=()) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=list(options))


def connection_hint(details: str, tls: bool, flags: TlsFlags = TlsFlags()) -> str:
    """What a connection error from grpc most likely means, or "" when it says nothing about TLS."""
    if "WRONG_VERSION_NUMBER" in details:
        return (f"the TLS handshake failed because the teacher does not speak TLS (started without --tls-cert): "
                f"drop {flags.ca}, or start the teacher with --tls-cert/--tls-key")
    if "CERTIFICATE_VERIFY_FAILED" in details or "certificate verif" in details.lower():
        return (f"the teacher's certificate is not signed by the CA given in {flags.ca}: pass the CA that signed "
                "the teacher's --tls-cert")
    if "handshake" in details.lower() or "SSL_ERROR" in details:
        return (f"the TLS handshake with the teacher failed: check {flags.ca}, and that the certificate names "
                "the host you dial (its subjectAltName)")
    if "Socket closed" in details:
        if tls:
            return (f"the teacher closed the connection during TLS set-up: it may require a client certificate "
                    f"(--tls-client-ca): pass {flags.cert} and {flags.key}")
        return (f"the teacher closed the plaintext connection: it may serve TLS (--tls-cert): pass its CA with "
                f"{flags.ca}. Or this is not its gRPC port")
    return ""


def wait_until_reachable(channel: grpc.Channel, address: str, timeout_s: float, *, tls: bool,
                         flags: TlsFlags = TlsFlags(), closed_for_s: float = 2.0) -> None:
    """Returns once the teacher answers a grpc health check; raises TeacherUnreachable.

    A failed TLS handshake does not heal, so it is reported at once; a connection the
    server keeps closing (plaintext against TLS, a missing client certificate) after
    `closed_for_s`; anything else (nothing listening yet: the model is loading) is retried
    until `timeout_s`.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    closed_since = None
    details = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=min(remaining, 5.0), wait_for_ready=False)
            return
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return  # something answered (e.g. no health service): the channel works
            details = e.details() or e.code().name
        hint = connection_hint(details, tls, flags)
        now = time.monotonic()
        if hint and "Socket closed" not in details:
            raise TeacherUnreachable(f"cannot talk to the teacher at {address}: {hint} (grpc: {details})")
        if hint:
            closed_since = closed_since or now
            if now - closed_since >= closed_for_s:
                raise TeacherUnreachable(f"cannot talk to the teacher at {address}: {hint} (grpc: {details})")
        else:
            closed_since = None
        time.sleep(min(0.2, max(0.0, deadline - now)))
    hint = connection_hint(details, tls, flags)
    raise TeacherUnreachable(
        f"no teacher answered at {address} within {timeout_s:.0f}s (grpc: {details}): "
        + (hint if hint else "start one (python -m teacher_server --model ...) or check the address"))

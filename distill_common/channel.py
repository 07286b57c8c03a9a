"""The client end of the control plane: a gRPC channel, plaintext or TLS, and a wait
for the teacher that tells a TLS mismatch apart from a teacher that is not up yet, and
from one that closes every new connection because it is at its connection cap.

Used by `TeacherClient` and by `teacher-server status|info`. Each caller names its own
flags (`flags`), so the hints say what to change where the user typed it.
"""

from __future__ import annotations

import socket
import ssl
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


AT_CONNECTION_CAP = ("the teacher closes every new connection at once, before any TLS or HTTP/2: it is at its "
                     "--grpc-max-connections cap (gRPC connections open at once; one without a call closes after "
                     "its --grpc-idle-timeout-s). Retry later; its operator can raise --grpc-max-connections or find "
                     "what holds its connections")


def closes_at_once(address: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the server at `address` closes a new connection before it answers a TLS handshake.

    grpc gives one message, "Socket closed", for a plaintext client of a TLS teacher, for a
    TLS client that a teacher asking for client certificates refuses, and for any client of a
    teacher at its connection cap (grpc.max_allowed_incoming_connections), which closes each new
    connection as it accepts it. A TLS handshake (certificates not checked) tells them apart: a
    TLS teacher answers it, client certificate or not; a teacher at its cap closes first. None:
    cannot tell (no host:port address, nothing listening, no answer in time).
    """
    target = _host_port(address)
    if target is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection(target, timeout=timeout_s) as sock:
            with context.wrap_socket(sock, server_hostname=target[0]):
                return False  # handshake done: it speaks TLS
    except (ssl.SSLEOFError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        return True
    except ssl.SSLError:  # an alert: it answered in TLS (a client certificate asked for, say)
        return False
    except OSError:  # refused, unreachable, timed out
        return None


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC target such as "host:port", "dns:///host:port", "ipv4:1.2.3.4:5" or
    "[::1]:5"; None for other forms (unix sockets, several addresses)."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
            break
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "," in address or "/" in address:
        return None
    return host.strip("[]"), int(port)


def connection_hint(details: str, tls: bool, flags: TlsFlags = TlsFlags(), address: str = "") -> str:
    """What a connection error from grpc most likely means, or "" when it says nothing about TLS.

    With `address`, a connection the teacher closed is told apart (`closes_at_once`): one at its
    connection cap gets AT_CONNECTION_CAP, not a TLS hint."""
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
        if address and closes_at_once(address):
            return AT_CONNECTION_CAP
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
    `closed_for_s`, unless the teacher closes every new connection at once, at its
    connection cap, which heals as connections close; that and anything else (nothing
    listening yet: the model is loading) is retried until `timeout_s`.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    closed_since = None
    details = "no answer"
    cap_hint = ""  # the last verdict on a closed connection: the teacher at its connection cap
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
                hint = cap_hint = connection_hint(details, tls, flags, address)
                if hint != AT_CONNECTION_CAP:
                    raise TeacherUnreachable(f"cannot talk to the teacher at {address}: {hint} (grpc: {details})")
                closed_since = now  # asked again after another closed_for_s
        else:
            closed_since, cap_hint = None, ""
        time.sleep(min(0.2, max(0.0, deadline - now)))
    hint = cap_hint or connection_hint(details, tls, flags)
    raise TeacherUnreachable(
        f"no teacher answered at {address} within {timeout_s:.0f}s (grpc: {details}): "
        + (hint if hint else "start one (python -m teacher_server --model ...) or check the address"))

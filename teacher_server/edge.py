"""What stands between the teacher's ports and its code: bounds that hold before a caller's
token is checked, so that nobody without it can make the teacher buffer, hold or log much.

- gRPC, `CallGuard`: an interceptor, which grpc runs when a call's headers arrive, before
  its request is read. It checks the token, then the budget of the caller's job (streams,
  calls, heartbeats); only then is the request read (within --request-timeout-s) and the
  handler run. Requests are also capped by grpc itself (--max-request-bytes), and
  connections by grpc's server options (`grpc_server_options`: idle ones closed, a cap on
  their number below the descriptor limit).
- Who a token belongs to, `Callers`: the operator (--auth-token) or one job (--job-tokens),
  and what that caller may use; the handlers ask it with `Callers.of(context)`.
- HTTP, `GuardedH11Protocol`: uvicorn's h11 protocol with deadlines for whole requests
  (headers and body) and for the peer to take the answers, a cap on request bodies and a cap
  on open connections.
- `install_accept_error_log`: out of descriptors, asyncio's accept loop logs a traceback
  per failed attempt (thousands a second on Python 3.11); one line every 10 s says it instead.
- `release_free_memory`: what refused requests leave in the allocator's heap goes back to the
  system, every RELEASE_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import hashlib
import hmac
import inspect
import itertools
import logging
import resource
import socket
import struct
import termios
import time
from dataclasses import dataclass

import grpc
import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from distill_common.settings import flag
from teacher_server.config import ServerConfig
from teacher_server.errors import ResourceExhausted, ServiceError, Unauthenticated
from teacher_server.metrics import Metrics

log = logging.getLogger(__name__)

_OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})  # probes carry no token


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether `authorization` is `Bearer <token>` (compared in constant time); true when no token is set."""
    return not token or hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())


@dataclass(frozen=True)
class Caller:
    """Who a call comes from, and what it may use at Join.

    The operator (the shared --auth-token, or anyone when the teacher has no token) may join
    as any job and sees every session; a job token's holder joins only as its job and sees
    only its sessions. Acting on a session needs that session's secret in either case.
    """

    job_id: str | None  # None: the operator
    max_weight: float
    max_sessions: int  # sessions of one job at once; 0: only --max-sessions bounds them

    def limit(self, key: str) -> str:
        """A limit of this caller ("max_weight" or "max_sessions") and where it is set, for a
        message: the teacher's flag, or the job's entry in --job-tokens."""
        value = getattr(self, key)
        if self.job_id is None:
            return f"the teacher's {flag({'max_weight': 'max_weight', 'max_sessions': 'max_sessions_per_job'}[key])} {value}"
        return f"{key} {value} of job {self.job_id!r} in the teacher's --job-tokens"


class Callers:
    """The tokens a teacher accepts and whose each is: one home for the token check.

    Job tokens are looked up by their SHA-256, so the lookup's timing says nothing about
    which characters of a token were right; the operator's is compared in constant time.
    """

    def __init__(self, config: ServerConfig):
        self._operator_token = config.auth_token
        self.operator = Caller(None, config.max_weight, config.max_sessions_per_job)
        self._jobs = {_digest(e.token): Caller(e.job_id, config.max_weight if e.max_weight is None else e.max_weight,
                                               config.max_sessions_per_job if e.max_sessions is None else e.max_sessions)
                      for e in config.job_token_entries}

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller that `authorization` (the header's value) names, or None: a missing or wrong token."""
        if bearer_matches(authorization, self._operator_token):
            return self.operator
        if authorization and authorization.startswith("Bearer "):
            return self._jobs.get(_digest(authorization[len("Bearer "):]))
        return None

    def of(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of a call that CallGuard let through."""
        caller = self.caller(_metadata_value(context.invocation_metadata(), "authorization"))
        if caller is None:  # CallGuard refuses such calls before any handler runs
            raise Unauthenticated("missing or wrong auth token")
        return caller


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _metadata_value(metadata, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value
    return None


class RateLimitedLog:
    """At most one line per `interval_s` for an event that can recur thousands of times a
    second, with how often it happened since the last line."""

    def __init__(self, interval_s: float = 10.0, logger: logging.Logger | None = None, level: int = logging.WARNING):
        self.interval_s = interval_s
        self._logger, self._level = logger or log, level
        self._last = float("-inf")
        self._count = 0

    def emit(self, message: str, *args) -> None:
        """The line at this log's level (WARNING unless told), if none went out in `interval_s`."""
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._logger.log(self._level, message + " [%d since the last such line]", *args, self._count)
            self._last, self._count = now, 0


class _PeerWarnings:
    """uvicorn's logger as GuardedH11Protocol uses it: its warnings, each about one request of
    a peer's (an invalid request, an unsupported upgrade), a line per 10 s each with a count
    (they were a line a request, 3,800 a second from one client without a token); the rest as
    uvicorn logs it."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._limits: dict[str, RateLimitedLog] = {}  # by message: uvicorn's are a few constants

    def warning(self, message: str, *args) -> None:
        limited = self._limits.get(message)
        if limited is None:
            limited = self._limits[message] = RateLimitedLog()
        limited.emit(message, *args)

    def __getattr__(self, name: str):
        return getattr(self._logger, name)


def install_accept_error_log(loop: asyncio.AbstractEventLoop) -> None:
    """Accept errors for want of descriptors or memory become one line every 10 s."""
    limited = RateLimitedLog()
    default = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        if (isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
                and context.get("message", "").startswith("socket.accept()")):
            limited.emit("cannot accept connections: %s; raise the descriptor limit (ulimit -n) or lower "
                         "--http-max-connections", error)
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


# ---- gRPC ---------------------------------------------------------------------------------


# Descriptors kept for what is not a gRPC connection: per session its data plane (a gloo pair
# or NCCL's sockets and the threads' pipes), and for the process itself (model files, logs,
# the engine's and grpc's own pipes and epoll).
DESCRIPTORS_PER_SESSION = 16
DESCRIPTORS_FOR_THE_PROCESS = 256
DEFAULT_GRPC_MAX_CONNECTIONS = 8192


def raise_descriptor_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit (at most 2**20) and returns it: every
    bound below is set against it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft if soft != resource.RLIM_INFINITY else want
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, e)
        return soft
    return want


# How often the teacher gives the allocator's free pages back to the system.
RELEASE_INTERVAL_S = 5.0


def _libc_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator has a policy of its own
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_free_memory() -> bool:
    """Gives the pages the allocator holds free back to the system (glibc's malloc_trim); False
    where the allocator is not glibc's.

    Requests of up to --max-request-bytes (MiBs: a Join's vocabulary) arrive, are refused and
    freed by the thousand. glibc raises its mmap threshold to the size of each mapped block
    freed, so that after the first such request they come from the heap, whose free pages go
    back only when its top is free: measured, 128 calls at once of 1.8 MiB each left the
    teacher +261 MiB for minutes after they ended. Trimming every few seconds gives them back
    without changing where the forward's buffers come from.
    """
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def grpc_connections_limit(config: ServerConfig, descriptors: int) -> int:
    """How many gRPC connections may be open: --grpc-max-connections (0: 8192), at most what the
    descriptor limit leaves once HTTP (its cap and accept backlog), the sessions' data planes
    and the process itself have theirs. With too few descriptors for all of that, a quarter of
    them, and a warning that says what to raise."""
    reserved = (2 * config.http_max_connections + DESCRIPTORS_PER_SESSION * config.max_sessions
                + DESCRIPTORS_FOR_THE_PROCESS)
    room = descriptors - reserved
    if room < 64:
        room = max(16, descriptors // 4)
        log.warning("the descriptor limit %d (ulimit -n) leaves too few for gRPC connections once HTTP, %d sessions' "
                    "data planes and the process have theirs (%d): gRPC connections are capped at %d; raise the "
                    "limit, or lower --max-sessions or --http-max-connections", descriptors, config.max_sessions,
                    reserved, room)
    return min(config.grpc_max_connections or DEFAULT_GRPC_MAX_CONNECTIONS, room)


def grpc_server_options(config: ServerConfig, max_connections: int) -> list[tuple[str, int]]:
    """grpc's own bounds on connections, which hold before any call reaches `CallGuard`.

    A connection with no call in progress for --grpc-idle-timeout-s is closed (a GOAWAY: a
    client reconnects on its next call), and so is one that has not finished its handshake by
    then; past `max_connections`, new connections are closed at once. A submit stream lives as
    long as its session, so connections have no maximum age.
    """
    idle_ms = int(config.grpc_idle_timeout_s * 1000)
    return [("grpc.max_receive_message_length", config.request_limit_bytes),
            # Answers are the teacher's own (a status of many sessions may be large).
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_connection_idle_ms", idle_ms),
            ("grpc.server_handshake_timeout_ms", idle_ms),
            ("grpc.max_allowed_incoming_connections", max_connections),
            ("grpc.max_concurrent_streams", config.grpc_max_streams_per_connection)]


# Calls that keep a session alive or end it: a budget of their own, so that a job's other
# calls (a burst of submits, a stuck status poll) cannot make its sessions expire.
_UPKEEP_METHODS = frozenset({"/teacher.v1.TeacherService/Heartbeat", "/teacher.v1.TeacherService/Leave"})
_BUDGET_NAMES = {"stream": "streams", "rpc": "calls", "upkeep": "heartbeats and leaves"}


class CallGuard(grpc.aio.ServerInterceptor):
    """Token first, then a budget, then the request: per call, in that order.

    Every handler is served as one whose requests stream (grpc runs those at once, with the
    request still unread); unary and streaming calls look the same on the wire. That is
    what lets a refusal go out without the request being read, and what makes the budget
    of a call end in one `finally`, also for a call cancelled before it sent anything.

    Budgets are per caller, once the token is read: each job (by its job token) and the
    operator's token (every caller when the teacher has no token) has its own streams, calls,
    and heartbeats-and-leaves, so calls held open by one job, however many, refuse only that
    job's further calls (`ServerConfig.job_rpcs_limit`, `job_streams_limit`). A unary call
    whose request does not come within --request-timeout-s is refused, so a half-open call
    holds its budget for that long at most.

    Health checks carry no token (probes): a check holds no budget once its request is
    read, as it is answered at once; of those still waiting for their request at most
    --max-rpcs are kept, a new one displacing the oldest, so a caller holding many open
    cannot lock the probes out.
    """

    def __init__(self, callers: Callers, config: ServerConfig, metrics: Metrics):
        self.metrics = metrics
        self._callers = callers
        self._config = config
        self._request_timeout_s = config.request_timeout_s
        self._in_progress: dict[tuple[str | None, str], int] = {}  # (job id, budget) -> calls; None: the operator
        self._waiting_checks: dict[asyncio.Future, None] = {}  # oldest first
        self._displaced: set[asyncio.Future] = set()

    def limit(self, caller: Caller, budget: str) -> tuple[int, str]:
        """How many calls of `budget` the caller may have in progress, and the flag that says so."""
        c = self._config
        if budget == "stream":
            if caller.job_id is None:
                return c.streams_limit, "--max-streams"
            return c.job_streams_limit(caller.max_sessions), "2 per session the job may hold, at most --max-streams"
        if caller.job_id is None:
            return c.rpcs_limit, "--max-rpcs"
        return c.job_rpcs_limit(caller.max_sessions), "--max-job-rpcs"

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED
        name = details.method.rsplit("/", 1)[-1]
        if details.method in _OPEN_METHODS:
            return self._guarded(handler, name, None, None)
        caller = self._callers.caller(_metadata_value(details.invocation_metadata, "authorization"))
        if caller is None:
            return self._refusal(handler, name, Unauthenticated(
                "missing or wrong auth token: pass the teacher's token to the client "
                "(TeacherClient(auth_token=...) or TEACHER_AUTH_TOKEN)"))
        if handler.request_streaming or handler.response_streaming:
            budget = "stream"
        else:
            budget = "upkeep" if details.method in _UPKEEP_METHODS else "rpc"
        return self._guarded(handler, name, caller, budget)

    def _count(self, name: str, error: ServiceError) -> None:
        self.metrics.rpc_errors.labels(name, error.code.name).inc()

    def _refusal(self, handler: grpc.RpcMethodHandler, name: str, error: ServiceError) -> grpc.RpcMethodHandler:
        async def refuse(requests, context):
            self._count(name, error)
            await context.abort(error.code, str(error))

        return _streaming_handler(handler, refuse)

    def _guarded(self, handler: grpc.RpcMethodHandler, name: str, caller: Caller | None,
                 budget: str | None) -> grpc.RpcMethodHandler:
        method = handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary
        key = (caller.job_id if caller is not None else None, budget)

        async def guarded(requests, context):
            if budget is not None:
                limit, flag = self.limit(caller, budget)
                if self._in_progress.get(key, 0) >= limit:
                    who = "the operator's token" if caller.job_id is None else f"job {caller.job_id!r}"
                    error = ResourceExhausted(f"{who} has {limit} {_BUDGET_NAMES[budget]} in progress, its limit "
                                              f"({flag}): end some, retry later, or raise that limit")
                    self._count(name, error)
                    await context.abort(error.code, str(error))
                self._in_progress[key] = self._in_progress.get(key, 0) + 1
            try:
                request = requests if handler.request_streaming else await self._read(name, context, budget is None)
                result = method(request, context)
                if not handler.response_streaming:
                    return await result
                if inspect.isasyncgen(result):
                    async for response in result:
                        await context.write(response)
                else:
                    await result  # writes with context.write itself
                return None
            finally:
                if budget is not None:
                    left = self._in_progress[key] - 1
                    if left:
                        self._in_progress[key] = left
                    else:
                        del self._in_progress[key]  # a job's entries go with its last call

        return _streaming_handler(handler, guarded)

    async def _read(self, name: str, context: grpc.aio.ServicerContext, displaceable: bool):
        """The request of a unary call, within --request-timeout-s; for an open call, displaced
        by newer ones past --max-rpcs."""
        read = asyncio.ensure_future(context.read())
        if displaceable:
            self._waiting_checks[read] = None
            if len(self._waiting_checks) > self._config.rpcs_limit:
                oldest = next(iter(self._waiting_checks))
                del self._waiting_checks[oldest]
                if oldest.cancel():  # else its request has just come: it is answered
                    self._displaced.add(oldest)
        try:
            request = await asyncio.wait_for(read, self._request_timeout_s)
        except asyncio.TimeoutError:
            error = ResourceExhausted(f"{name}: the request did not arrive within {self._request_timeout_s:g} s of the "
                                      "call's headers (--request-timeout-s)")
            self._count(name, error)
            await context.abort(error.code, str(error))
        except asyncio.CancelledError:
            if read not in self._displaced:
                raise
            self._displaced.discard(read)
            error = ResourceExhausted(f"more than {self._config.rpcs_limit} health checks were waiting for their "
                                      "request (--max-rpcs); this one, the oldest, was dropped")
            self._count(name, error)
            await context.abort(error.code, str(error))
        finally:
            self._waiting_checks.pop(read, None)
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the call ended without a request")
        return request


def _streaming_handler(handler: grpc.RpcMethodHandler, behaviour) -> grpc.RpcMethodHandler:
    """`behaviour` as a handler with streamed requests, with `handler`'s (de)serializers."""
    make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


# ---- HTTP ---------------------------------------------------------------------------------


class HttpConnections:
    """The open connections of one HTTP server, and those a new one may displace, oldest first."""

    def __init__(self, max_connections: int, header_timeout_s: float, send_timeout_s: float,
                 max_body_bytes: int = 1024, min_send_bytes_per_s: float = 64 << 10):
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.send_timeout_s = send_timeout_s
        self.min_send_bytes_per_s = min_send_bytes_per_s
        self.send_check_s = min(SEND_CHECK_S, send_timeout_s / 4)
        self.max_body_bytes = max_body_bytes
        self.open: set[GuardedH11Protocol] = set()
        self.displaceable: dict[GuardedH11Protocol, None] = {}  # by when they became displaceable
        self.displaced_log = RateLimitedLog()
        self.timed_out_log = RateLimitedLog()
        self.send_timed_out_log = RateLimitedLog()
        self.send_slow_log = RateLimitedLog()
        self.body_log = RateLimitedLog()
        self.peer_warnings = _PeerWarnings(logging.getLogger("uvicorn.error"))

    def to_displace(self, newcomer: "GuardedH11Protocol") -> "GuardedH11Protocol":
        """The connection a newcomer past the cap closes: among the DISPLACE_SCAN oldest
        displaceable ones, the first of the lowest `displace_rank`, else the newcomer itself.
        A probe connects and sends its request at once, but the loop may accept many
        connections between the two: new and silent meanwhile, it goes after every other kind;
        a peer taking a long answer at speed goes after the idle ones."""
        now = newcomer.loop.time()
        best, best_rank = newcomer, _NEW + 1
        for connection in itertools.islice(self.displaceable, DISPLACE_SCAN):
            if connection is newcomer:
                continue
            rank = connection.displace_rank(now, self.min_send_bytes_per_s)
            if rank < best_rank:
                best, best_rank = connection, rank
                if rank == _STALLED:
                    break
        return best


# The order in which a newcomer past --http-max-connections displaces connections (lowest first):
# - stalled: sent part of a request or have an answer pending, and moved less than the minimum rate
#   (--http-min-send-bytes-per-s) over the JUDGED_S since;
# - not yet judged (part of a request, an answer of which nothing was taken yet, less than JUDGED_S
#   ago), and every connection that pipelines (sends requests before taking the answers: no probe
#   and no ordinary client does; without a token it is the one way to have answers to take);
# - idle: nothing of a request for JUDGED_S or more since it opened or its last answer;
# - moving: taking one answer (or sending one request) at the minimum rate or more;
# - new: nothing of a request yet, less than JUDGED_S since it opened or its last answer (a probe
#   whose request the loop has not read yet).
_STALLED, _UNJUDGED, _IDLE, _MOVING, _NEW = range(5)
JUDGED_S = 1.0
# How many of the oldest displaceable connections a newcomer looks through (a bounded cost per
# accept, whatever the cap).
DISPLACE_SCAN = 64


# The kernel's send buffer of a HTTP connection (SO_SNDBUF, which also stops the kernel from
# sizing it itself: it would give a peer that never reads megabytes at once). A connection
# starts with HTTP_SEND_BUFFER_BYTES, what the kernel holds for a peer that takes nothing: how
# many answers such a peer gets before the teacher's sends wait. While a peer takes what is sent
# as fast as it is sent (a buffer's worth between two checks), its buffer doubles, up to
# HTTP_SEND_BUFFER_MAX_BYTES, and it is back to the small one once the answer is sent. The
# small one alone would pace a large answer by the peer's delayed ACKs: with under two
# segments in flight the peer waits ~40 ms before acknowledging (measured on loopback, one
# 30 MB answer: 16 KiB 1.6 MB/s, 128 KiB 600 MB/s).
HTTP_SEND_BUFFER_BYTES = 16 << 10
HTTP_SEND_BUFFER_MAX_BYTES = 256 << 10
# What may wait in the transport's buffer (asyncio's default: 64 KiB) before the connection's
# next answer and its reading wait, and the send checks run: a few answers. Not 0: a TLS
# transport pauses at a size >= the mark, and holds the end of its handshake at first.
HTTP_WRITE_BUFFER_BYTES = 4 << 10
# How often a connection whose answers wait for its peer reads what the peer has taken: soon
# after the wait starts and while its send buffer grows, then every SEND_CHECK_S (at most a
# quarter of --http-send-timeout-s): the slack of that timeout.
SEND_GROW_CHECK_S = 0.02
SEND_CHECK_S = 0.25

# What a connection waits on its peer for: each has its deadline.
_REQUEST = "a whole request"
_TAKEN = "the answer to be taken"


class _Taking:
    """One wait of a connection for its peer to take what was sent: since when, and what the
    peer's TCP had acknowledged then and at the last check."""

    def __init__(self, now: float, acked_bytes: int):
        self.start = now
        self.last_taken = now  # when the peer last took a byte (the wait's start before that)
        self.acked_at_start = acked_bytes
        self.acked_bytes = acked_bytes


def bytes_acked(sock: socket.socket | None) -> int:
    """What the peer's TCP has acknowledged of what this socket sent (tcp_info's bytes_acked,
    Linux >= 4.1; 0 where it is not there: every wait then reads as no progress)."""
    if sock is None or sock.fileno() < 0:
        return 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return 0
    return struct.unpack_from("Q", info, _BYTES_ACKED_AT)[0] if len(info) >= _BYTES_ACKED_AT + 8 else 0


# struct tcp_info (linux/tcp.h): tcpi_bytes_acked is the u64 at offset 120.
_BYTES_ACKED_AT = 120
_TCP_INFO_BYTES = 136


# A whole request not yet answered: h11's states while the peer may only pipeline behind it
# (MIGHT_SWITCH_PROTOCOL: one with an Upgrade header, or CONNECT, answered as any other here).
_REQUEST_WHOLE = (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL)
# What h11 may hold of a peer's bytes behind such a request before reading stops: a little, so
# that a peer gone behind a stray byte (a CRLF some clients send) is still seen going.
READ_AHEAD_BYTES = 16 << 10


# What of a connection's bytes h11 and uvicorn parse in one turn of the loop; the rest of a read
# (asyncio reads up to 256 KiB) waits for the next turns, reading paused meanwhile, so that the
# loop goes round every connection (and the gRPC port: the same loop) between two slices. A read
# parsed whole took the loop for 40 ms and more (a body in chunks of one byte: an event of h11's
# and uvicorn's per byte), and let h11 take headers far over its 16 KiB, which it counts only
# while they are incomplete (97 KB of them, 14 ms). A slice costs ~11 us more than parsing it
# within a larger read (a body of 78 KB: 2.3 ms instead of 1.5).
PARSE_SLICE_BYTES = 1 << 10


class _GuardedFlow(FlowControl):
    """uvicorn's flow control, but reading does not resume while h11 holds READ_AHEAD_BYTES or
    more sent behind a whole request not yet answered (pipelined requests): uvicorn's
    `receive()` resumes reading at every call, after a request's body too (the completions
    route waits on it for the peer leaving), so a peer that pipelines requests while reading
    its answers would have the teacher read a buffer's worth ahead per answer, without a bound."""

    def __init__(self, transport, protocol: "GuardedH11Protocol"):
        super().__init__(transport)
        self._protocol = protocol

    def resume_reading(self) -> None:
        conn = self._protocol.conn
        if conn.their_state in _REQUEST_WHOLE and len(conn.trailing_data[0]) >= READ_AHEAD_BYTES:
            return  # uvicorn's on_response_complete, then GuardedH11Protocol's, go on with them
        if self._protocol.unparsed:  # the transport stays paused until they are parsed
            self.read_paused = False
            self._protocol.parse_later()
            return
        super().resume_reading()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds uvicorn lacks.

    - A deadline for the whole request, headers and body: uvicorn's keep-alive timeout
      starts only after a response, and a request's body has no deadline at all, so a
      connection that never completes a request stays open for good. Here a connection
      must complete its request within --http-header-timeout-s of opening (or of its
      previous response), however slowly it trickles it.
    - Bounds on the peer taking what the teacher sends. The kernel's send buffer is small
      (`HTTP_SEND_BUFFER_BYTES`, grown only while the peer keeps up: `HTTP_SEND_BUFFER_MAX_BYTES`),
      and so is the transport's (`HTTP_WRITE_BUFFER_BYTES`), so `pause_writing` means "the
      peer's TCP has not taken what was sent yet": the next answer waits (uvicorn's `drain`),
      reading waits too, and until the transport's buffer is down to its low-water mark the
      connection checks what the peer's TCP has acknowledged (`bytes_acked`). It is closed
      when the peer has taken nothing for --http-send-timeout-s (a peer that pipelines
      requests and never reads would otherwise hold its connection, with a request in
      progress, for good), or when, that long into the wait, it has taken less than
      --http-min-send-bytes-per-s over the wait (a peer that reads a byte now and then: the
      wait for an answer of N bytes lasts at most the timeout + N / that rate). A peer that
      reads steadily is never cut, however large the answer. A connection closed with bytes
      unsent is aborted: asyncio's close would wait for the peer to take them first.
    - Pipelined input is bounded: h11 parses one request at a time and uvicorn stops reading
      while one is answered with the next already buffered; here reading also stops while
      the peer has not taken an answer, and (`_GuardedFlow`) while h11 holds 16 KiB or more
      pipelined behind the one being answered, whatever uvicorn's `receive()` asks. What a
      connection can make the teacher buffer is one read (asyncio's, 256 KiB) of requests
      not yet answered, past those 16 KiB.
    - A cap on open connections, --http-max-connections: a new connection past it closes
      the oldest displaceable one (itself if no other is): one waiting on its peer (for a
      whole request, or to take an answer) or one that has pipelined (sent a request
      before taking the answer to the one before); those that stalled with something sent
      or unsent go first, those moving data at speed last (`HttpConnections.to_displace`).
      A probe sends its request as soon as it
      connects and reads the answer, so sockets held open by others cannot lock it out, as
      a plain refusal past the cap would; the cap also keeps descriptors for the gRPC port
      and the data plane.
    - A cap on request bodies, --http-max-body-bytes (no endpoint reads one): a larger one,
      declared or sent, is answered 413 and the connection closed.

    - A connection's bytes are parsed PARSE_SLICE_BYTES a turn of the loop (the rest of a read
      waits, reading paused), so that no request dear to parse (a body in one-byte chunks, a
      whole read of headers) holds the loop that every connection and the gRPC port share.

    - uvicorn's warnings about a peer's request (invalid, an upgrade it does not serve) are a
      line per 10 s each, with a count (`_PeerWarnings`).

    The headers' size is h11's limit (16 KiB, a 400 beyond: h11 counts it while they are
    incomplete, which they are at every slice past it), so a connection buffers little.
    Built with functools.partial(GuardedH11Protocol, connections=HttpConnections(...)).
    """

    def __init__(self, *args, connections: HttpConnections, **kwargs):
        super().__init__(*args, **kwargs)
        self.logger = connections.peer_warnings
        self.guard = connections
        self._waiting_for: str | None = None  # _REQUEST, _TAKEN or None
        self._deadline: asyncio.TimerHandle | None = None
        self._taking: _Taking | None = None  # while _TAKEN
        self._send_buffer_bytes = HTTP_SEND_BUFFER_BYTES
        self._pipelined = False
        self._idle_since = self.loop.time()  # when it opened, or its last answer was complete
        self._heard_at: float | None = None  # when the first byte since the opening or the last answer came
        self._heard_bytes = 0  # what came since
        self._body_bytes = 0  # of the request whose body is coming
        self.unparsed = bytearray()  # read, not yet handed to h11: PARSE_SLICE_BYTES a turn
        self._parsing: asyncio.Handle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.flow = _GuardedFlow(transport, self)
        transport.set_write_buffer_limits(high=HTTP_WRITE_BUFFER_BYTES)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, HTTP_SEND_BUFFER_BYTES)
        self.guard.open.add(self)
        self._track()
        if len(self.guard.open) > self.guard.max_connections:
            oldest = self.guard.to_displace(self)
            self.guard.displaced_log.emit("closed the oldest HTTP connection waiting on its peer or pipelining: "
                                          "%d open, the --http-max-connections limit", len(self.guard.open) - 1)
            oldest._close()

    def data_received(self, data: bytes) -> None:
        if self.unparsed or len(data) > PARSE_SLICE_BYTES:
            self.unparsed += data
            self.transport.pause_reading()  # (uvicorn resumes the transport itself after some answers)
            self.parse_later()
            return
        self._parse(data)

    def parse_later(self) -> None:
        """The next slice of `unparsed` on a later turn of the loop, unless reading is paused."""
        if self._parsing is None and not self.flow.read_paused:
            self._parsing = self.loop.call_soon(self._parse_slice)

    def _parse_slice(self) -> None:
        self._parsing = None
        if self.transport.is_closing():
            self.unparsed.clear()
            return
        data = bytes(self.unparsed[:PARSE_SLICE_BYTES])
        del self.unparsed[:PARSE_SLICE_BYTES]  # (from the front of a bytearray: no copy of the rest)
        self._parse(data)
        if self.unparsed:
            self.parse_later()  # or once uvicorn resumes reading (_GuardedFlow)
        elif not self.flow.read_paused and not self.transport.is_closing():
            self.transport.resume_reading()

    def _parse(self, data: bytes) -> None:
        in_body = self.conn.their_state is h11.SEND_BODY
        # A request complete and not yet answered, and more comes: the peer pipelines.
        ahead = self.conn.their_state in _REQUEST_WHOLE
        if self._heard_at is None:
            self._heard_at = self.loop.time()
        self._heard_bytes += len(data)
        super().data_received(data)
        # uvicorn pauses reading when h11 holds a request behind the one being answered.
        if ahead or (self.conn.their_state in _REQUEST_WHOLE and self.flow.read_paused):
            self._pipelined = True
        if self.conn.their_state is h11.SEND_BODY:
            self._body_bytes = self._body_bytes + len(data) if in_body else 0
            if self._body_too_large():
                self._refuse_body()
                return
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # resumes reading, and handles a request pipelined behind
        self._idle_since = self.loop.time()
        if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self._heard_at, self._heard_bytes = None, 0  # the next request starts from nothing
        else:  # judged from now on, by what is there of the next request
            self._heard_at, self._heard_bytes = self._idle_since, len(self.conn.trailing_data[0])
        if self.flow.write_paused:
            self.flow.pause_reading()
        elif self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # the pipelined bytes were not a whole request
            self.flow.resume_reading()
        self._track()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.flow.pause_reading()
        self._track()

    def resume_writing(self) -> None:
        super().resume_writing()
        # Only if h11 waits for the peer's bytes: with a request buffered behind the one being
        # answered, reading resumes when that answer is complete (uvicorn's on_response_complete).
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.flow.resume_reading()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self.unparsed.clear()
        self._stop_waiting()
        self.guard.open.discard(self)
        super().connection_lost(exc)

    def _body_too_large(self) -> bool:
        declared = next((value for name, value in self.headers if name == b"content-length"), b"0")
        try:
            declared_bytes = int(declared)
        except ValueError:  # h11 refuses such a header before this
            declared_bytes = 0
        return max(declared_bytes, self._body_bytes) > self.guard.max_body_bytes

    def _refuse_body(self) -> None:
        self.guard.body_log.emit("refused a HTTP request body over %d bytes (--http-max-body-bytes)",
                                 self.guard.max_body_bytes)
        if self.cycle is None or not self.cycle.response_started:
            text = f"request bodies are limited to {self.guard.max_body_bytes} bytes (--http-max-body-bytes)\n"
            self.transport.write(b"HTTP/1.1 413 Content Too Large\r\ncontent-type: text/plain\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(text), text.encode()))
        if self.cycle is not None:
            self.cycle.disconnected = True  # the app's response, if it comes, goes nowhere
        self._close()

    def _track(self) -> None:
        """Starts or stops the deadline as the connection waits on its peer (for a whole request,
        or to take what was sent) or not, and keeps it among the displaceable ones while it
        waits or once it has pipelined."""
        if self.flow.write_paused:
            waiting_for = _TAKEN  # also once closing: the transport closes only when they are taken
        elif self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            waiting_for = _REQUEST
        else:
            waiting_for = None
        # Between two pieces of one answer the wait goes on: its clock, rate and send buffer.
        mid_answer = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if waiting_for is not self._waiting_for:
            self._cancel_deadline()
            if self._waiting_for is _TAKEN and not mid_answer:
                self._end_taking()
            self._waiting_for = waiting_for
            if waiting_for is _TAKEN:
                if self._taking is None:
                    self._taking = _Taking(self.loop.time(), bytes_acked(self._socket()))
                self._deadline = self.loop.call_later(SEND_GROW_CHECK_S, self._check_taken)
            elif waiting_for is _REQUEST:
                self._deadline = self.loop.call_later(self.guard.header_timeout_s, self._header_timeout)
        elif waiting_for is None and self._taking is not None and not mid_answer:
            self._end_taking()
        if waiting_for is not None or self._pipelined:
            self.guard.displaceable.setdefault(self, None)
        else:
            self.guard.displaceable.pop(self, None)

    def displace_rank(self, now: float, min_bytes_per_s: float) -> int:
        """Where this displaceable connection comes in HttpConnections.to_displace's order."""
        taking = self._taking
        if self._pipelined:
            return _UNJUDGED
        if self._waiting_for is _TAKEN and taking is not None:
            waited = now - taking.start
            taken = taking.acked_bytes - taking.acked_at_start
            if waited < JUDGED_S:
                return _MOVING if taken else _UNJUDGED
            stalled = now - taking.last_taken >= JUDGED_S or taken < min_bytes_per_s * waited
            return _STALLED if stalled else _MOVING
        if self._waiting_for is _REQUEST and self._heard_at is not None:
            waited = now - self._heard_at
            if waited < JUDGED_S:
                return _UNJUDGED
            return _STALLED if self._heard_bytes < min_bytes_per_s * waited else _MOVING
        return _IDLE if now - self._idle_since >= JUDGED_S else _NEW

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _stop_waiting(self) -> None:
        self._cancel_deadline()
        self._waiting_for = None
        self._taking = None
        self.guard.displaceable.pop(self, None)

    def _socket(self) -> socket.socket | None:
        return self.transport.get_extra_info("socket") if self.transport is not None else None

    def _set_send_buffer(self, size_bytes: int) -> None:
        sock = self._socket()
        if size_bytes != self._send_buffer_bytes and sock is not None and sock.fileno() >= 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size_bytes)
            self._send_buffer_bytes = size_bytes

    def _end_taking(self) -> None:
        """The peer took the answers down to the transport's low-water mark: the kernel's buffer
        goes back to the small one (what it holds beyond stays until the peer takes it)."""
        self._taking = None
        self._set_send_buffer(HTTP_SEND_BUFFER_BYTES)

    def _check_taken(self) -> None:
        """While answers wait for the peer: what it took since the last check; closes the
        connection past --http-send-timeout-s without progress, or below
        --http-min-send-bytes-per-s once that long into the wait; grows the send buffer while
        the peer takes a buffer's worth between two checks."""
        taking = self._taking
        if taking is None:
            return
        now = self.loop.time()
        acked = bytes_acked(self._socket())
        took = acked - taking.acked_bytes
        taking.acked_bytes = acked
        if took > 0:
            taking.last_taken = now
        guard = self.guard
        if now - taking.last_taken >= guard.send_timeout_s:
            guard.send_timed_out_log.emit("closed a HTTP connection whose peer had taken nothing of the answer for "
                                          "%.0f s (--http-send-timeout-s)", guard.send_timeout_s)
            self._close()
            return
        waited_s = now - taking.start
        taken = acked - taking.acked_at_start
        if taken < guard.min_send_bytes_per_s * (waited_s - guard.send_timeout_s):
            guard.send_slow_log.emit("closed a HTTP connection whose peer took %d bytes of the answer in %.1f s, "
                                     "less than %d bytes/s past the first %.0f s (--http-min-send-bytes-per-s, "
                                     "--http-send-timeout-s)", taken, waited_s, guard.min_send_bytes_per_s,
                                     guard.send_timeout_s)
            self._close()
            return
        grow = took >= self._send_buffer_bytes and self._send_buffer_bytes < HTTP_SEND_BUFFER_MAX_BYTES
        if grow:
            self._set_send_buffer(min(2 * self._send_buffer_bytes, HTTP_SEND_BUFFER_MAX_BYTES))
        self._deadline = self.loop.call_later(SEND_GROW_CHECK_S if grow else guard.send_check_s, self._check_taken)

    def _header_timeout(self) -> None:
        self.guard.timed_out_log.emit("closed a HTTP connection with no complete request after %.0f s "
                                      "(--http-header-timeout-s)", self.guard.header_timeout_s)
        self._close()

    def _close(self) -> None:
        """Leaves the open set at once: the transport reports the loss only on a later tick."""
        self._stop_waiting()
        self.guard.open.discard(self)
        if self._unsent_bytes():
            # close() would wait for the peer to take them first (asyncio's buffer), or leave
            # the kernel holding them after the descriptor is gone (its own, sent before the
            # FIN to a peer that may never take them): a reset drops both at once.
            sock = self._socket()
            if sock is not None and sock.fileno() >= 0:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
        else:
            self.transport.close()

    def _unsent_bytes(self) -> int:
        """Bytes written and not yet acknowledged by the peer: in the transport's buffer and the kernel's."""
        sock = self.transport.get_extra_info("socket")
        in_kernel = 0
        if sock is not None and sock.fileno() >= 0:
            in_kernel = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        return self.transport.get_write_buffer_size() + in_kernel

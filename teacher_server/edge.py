"""What stands between the teacher's ports and its code: bounds that hold before a caller's
token is checked, so that nobody without it can make the teacher buffer, hold or log much.

- gRPC, `CallGuard`: an interceptor, which grpc runs when a call's headers arrive, before
  its request is read. It checks the token, then the call's budget (--max-streams,
  --max-rpcs); only then is the request read and the handler run. Requests are also capped
  by grpc itself (--max-request-bytes, set on the server in app.py).
- Who a token belongs to, `Callers`: the operator (--auth-token) or one job (--job-tokens),
  and what that caller may use; the handlers ask it with `Callers.of(context)`.
- HTTP, `GuardedH11Protocol`: uvicorn's h11 protocol with a deadline for request headers
  and a cap on open connections.
- `install_accept_error_log`: out of descriptors, asyncio's accept loop logs a traceback
  per failed attempt (thousands a second on Python 3.11); one line every 10 s says it instead.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import inspect
import logging
import time
from dataclasses import dataclass

import grpc
import h11
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

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._last = float("-inf")
        self._count = 0

    def warning(self, message: str, *args) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            log.warning(message + " [%d since the last such line]", *args, self._count)
            self._last, self._count = now, 0


def install_accept_error_log(loop: asyncio.AbstractEventLoop) -> None:
    """Accept errors for want of descriptors or memory become one line every 10 s."""
    limited = RateLimitedLog()
    default = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        if (isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
                and context.get("message", "").startswith("socket.accept()")):
            limited.warning("cannot accept connections: %s; raise the descriptor limit (ulimit -n) or lower "
                            "--http-max-connections", error)
            return
        if default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


# ---- gRPC ---------------------------------------------------------------------------------


class CallGuard(grpc.aio.ServerInterceptor):
    """Token first, then a budget, then the request: per call, in that order.

    Every handler is served as one whose requests stream (grpc runs those at once, with the
    request still unread); unary and streaming calls look the same on the wire. That is
    what lets a refusal go out without the request being read, and what makes the budget
    of a call end in one `finally`, also for a call cancelled before it sent anything.

    Health checks carry no token (probes): a check holds no budget once its request is
    read, as it is answered at once; of those still waiting for their request at most
    --max-rpcs are kept, a new one displacing the oldest, so a caller holding many open
    cannot lock the probes out.
    """

    def __init__(self, callers: Callers, config: ServerConfig, metrics: Metrics):
        self.metrics = metrics
        self._callers = callers
        self._limits = {"stream": (config.streams_limit, "--max-streams"), "rpc": (config.rpcs_limit, "--max-rpcs")}
        self._in_progress = {"stream": 0, "rpc": 0}
        self._waiting_checks: dict[asyncio.Future, None] = {}  # oldest first
        self._displaced: set[asyncio.Future] = set()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED
        name = details.method.rsplit("/", 1)[-1]
        if details.method in _OPEN_METHODS:
            return self._guarded(handler, name, budget=None)
        if self._callers.caller(_metadata_value(details.invocation_metadata, "authorization")) is None:
            return self._refusal(handler, name, Unauthenticated(
                "missing or wrong auth token: pass the teacher's token to the client "
                "(TeacherClient(auth_token=...) or TEACHER_AUTH_TOKEN)"))
        budget = "stream" if handler.request_streaming or handler.response_streaming else "rpc"
        return self._guarded(handler, name, budget)

    def _count(self, name: str, error: ServiceError) -> None:
        self.metrics.rpc_errors.labels(name, error.code.name).inc()

    def _refusal(self, handler: grpc.RpcMethodHandler, name: str, error: ServiceError) -> grpc.RpcMethodHandler:
        async def refuse(requests, context):
            self._count(name, error)
            await context.abort(error.code, str(error))

        return _streaming_handler(handler, refuse)

    def _guarded(self, handler: grpc.RpcMethodHandler, name: str, budget: str | None) -> grpc.RpcMethodHandler:
        method = handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary

        async def guarded(requests, context):
            if budget is not None:
                limit, flag = self._limits[budget]
                if self._in_progress[budget] >= limit:
                    error = ResourceExhausted(f"the teacher has {limit} {'streams' if budget == 'stream' else 'calls'} "
                                              f"in progress, its {flag} limit: retry later, or raise {flag}")
                    self._count(name, error)
                    await context.abort(error.code, str(error))
                self._in_progress[budget] += 1
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
                    self._in_progress[budget] -= 1

        return _streaming_handler(handler, guarded)

    async def _read(self, name: str, context: grpc.aio.ServicerContext, displaceable: bool):
        """The request of a unary call; for an open call, displaced by newer ones past --max-rpcs."""
        read = asyncio.ensure_future(context.read())
        if displaceable:
            self._waiting_checks[read] = None
            if len(self._waiting_checks) > self._limits["rpc"][0]:
                oldest = next(iter(self._waiting_checks))
                del self._waiting_checks[oldest]
                if oldest.cancel():  # else its request has just come: it is answered
                    self._displaced.add(oldest)
        try:
            request = await read
        except asyncio.CancelledError:
            if read not in self._displaced:
                raise
            self._displaced.discard(read)
            error = ResourceExhausted(f"more than {self._limits['rpc'][0]} health checks were waiting for their "
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
    """The open connections of one HTTP server, and those waiting for a request, oldest first."""

    def __init__(self, max_connections: int, header_timeout_s: float):
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open: set[GuardedH11Protocol] = set()
        self.waiting: dict[GuardedH11Protocol, None] = {}  # by when they began to wait
        self.displaced_log = RateLimitedLog()
        self.timed_out_log = RateLimitedLog()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two bounds uvicorn lacks.

    - A deadline for request headers: uvicorn's keep-alive timeout starts only after a
      response, so a connection that never completes a request stays open for good. Here a
      connection must complete its request headers within --http-header-timeout-s of
      opening (or of its previous response), however slowly it trickles them.
    - A cap on open connections, --http-max-connections: a new connection past it closes
      the oldest connection still waiting for a request (itself if every other one has a
      request in progress). A probe sends its request as soon as it connects, so sockets
      held open by others cannot lock it out, as a plain refusal past the cap would; the
      cap also keeps descriptors for the gRPC port and the data plane.

    The headers' size is h11's limit (16 KiB, a 400 beyond), so a connection buffers little.
    Built with functools.partial(GuardedH11Protocol, connections=HttpConnections(...)).
    """

    def __init__(self, *args, connections: HttpConnections, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = connections
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.guard.open.add(self)
        self._track()
        if len(self.guard.open) > self.guard.max_connections:
            oldest = next((c for c in self.guard.waiting if c is not self), self)
            self.guard.displaced_log.warning("closed a HTTP connection waiting for a request: %d open, the "
                                      "--http-max-connections limit", len(self.guard.open) - 1)
            oldest._close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        self.guard.open.discard(self)
        super().connection_lost(exc)

    def _track(self) -> None:
        """Starts or stops the header deadline as the connection waits for a request or not."""
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._stop_waiting()
        elif self not in self.guard.waiting:
            self.guard.waiting[self] = None
            self._deadline = self.loop.call_later(self.guard.header_timeout_s, self._header_timeout)

    def _stop_waiting(self) -> None:
        self.guard.waiting.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _header_timeout(self) -> None:
        self.guard.timed_out_log.warning("closed a HTTP connection with no complete request after %.0f s "
                                  "(--http-header-timeout-s)", self.guard.header_timeout_s)
        self._close()

    def _close(self) -> None:
        """Leaves the open set at once: the transport reports the loss only on a later tick."""
        self._stop_waiting()
        self.guard.open.discard(self)
        self.transport.close()
